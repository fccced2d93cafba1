"""The reference's import paths, experimental (TRL up to 1.17) and stable (TRL 1.18), name the very objects
of `asyncgrpo`: a user of either TRL version switches by the import line."""

import importlib

import asyncgrpo
from asyncgrpo.generation.client import GenerationClient


def test_the_stable_trainer_module_names_the_trainer_and_config():
    stable = importlib.import_module("asyncgrpo.trainer.async_grpo_trainer")
    experimental = importlib.import_module("asyncgrpo.async_grpo_trainer")
    assert stable.AsyncGRPOTrainer is experimental.AsyncGRPOTrainer is asyncgrpo.AsyncGRPOTrainer
    assert stable._SupportsReset is experimental._SupportsReset
    config = importlib.import_module("asyncgrpo.trainer.async_grpo_config")
    assert config.AsyncGRPOConfig is asyncgrpo.AsyncGRPOConfig


def test_the_stable_client_module_names_the_generation_client():
    from asyncgrpo.generation.async_vllm_client import AsyncVLLMClient

    assert AsyncVLLMClient is GenerationClient
