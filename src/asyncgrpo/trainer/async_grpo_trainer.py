"""TRL 1.18's `trl.trainer.async_grpo_trainer`: the trainer and the environment protocol, the objects of
`asyncgrpo.async_grpo_trainer`."""

from asyncgrpo.config import AsyncGRPOConfig
from asyncgrpo.rollout.generate import EnvironmentFactory, SupportsReset
from asyncgrpo.train.trainer import AsyncGRPOTrainer

_SupportsReset = SupportsReset  # the reference's name for the environment protocol

__all__ = ["AsyncGRPOConfig", "AsyncGRPOTrainer", "EnvironmentFactory"]
