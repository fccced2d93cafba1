"""A tiny random Mixture-of-Experts model (qwen3_moe) trains against the embedded server on CPU, with
its router's load-balancing loss added and logged as `aux_loss` (the exact loss is checked in
tests/train/test_router_aux_loss.py)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

from asyncgrpo import AsyncGRPOConfig, AsyncGRPOTrainer
from asyncgrpo.launch import EmbeddedServer
from asyncgrpo.modeling.load import load_tokenizer, resolve_model_path

pytestmark = pytest.mark.process

os.environ.setdefault("HF_HUB_OFFLINE", "1")
TOKENIZER = "asyncgrpo/tiny-chat"


def tiny_moe() -> torch.nn.Module:
    config = CONFIG_MAPPING["qwen3_moe"](
        vocab_size=491, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
        decoder_sparse_step=1, mlp_only_layers=[], max_position_embeddings=1024, router_aux_loss_coef=0.01,
    )
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config)


def text_length_reward(completions, **kwargs) -> list[float]:
    """A reward with variance for a random model's output: its length modulo 3."""
    return [float(len(str(c[-1]["content"])) % 3) for c in completions]


@pytest.mark.slow
def test_a_tiny_moe_trains_against_the_embedded_server_with_aux_loss_logged(tmp_path):
    path = tmp_path / "tiny-moe"
    tiny_moe().save_pretrained(path)
    tokenizer = load_tokenizer(TOKENIZER)
    tokenizer.save_pretrained(path)
    shutil.copy(Path(resolve_model_path(TOKENIZER)) / "chat_template.jinja", path)
    rows = [{"prompt": [{"role": "user", "content": f"say {i}"}]} for i in range(16)]
    with EmbeddedServer(str(path), log_path=tmp_path / "server.log") as server:
        args = AsyncGRPOConfig(
            output_dir=str(tmp_path / "out"), vllm_server_base_url=server.url, num_generations=4,
            max_completion_length=16, learning_rate=1e-3, bf16=False, use_cpu=True,
            gradient_checkpointing=False, save_strategy="no", report_to="none", disable_tqdm=True,
            logging_steps=1, max_steps=2, seed=0, token_budget=256,
        )
        trainer = AsyncGRPOTrainer(model=str(path), reward_funcs=text_length_reward,
                                   train_dataset=rows, args=args)
        gate = trainer.model.model.layers[0].mlp.gate.weight
        before = gate.detach().clone()
        trainer.train()
    logs = [e for e in trainer.state.log_history if "loss" in e]
    assert len(logs) == 2
    for entry in logs:
        assert np.isfinite(entry["loss"]) and np.isfinite(entry["aux_loss"]) and entry["aux_loss"] > 0
    assert not torch.equal(before, gate.detach())
