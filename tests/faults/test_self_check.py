"""The embedded server refuses at load a model its engine would serve wrongly: the engine's log-probs
over a short prompt (prefill, then decode steps through the paged cache) are compared with the
model's own forward (item 8)."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
import torch
from conftest import TINY

from asyncgrpo.launch import free_port
from asyncgrpo.server.fused_layers import fuse_layers
from asyncgrpo.server.kv_cache import BlockAllocator, PagedKVCache, register_attention
from asyncgrpo.server.loading import load_served_model
from asyncgrpo.server.runner import ModelRunner
from asyncgrpo.server.scheduler import Scheduler
from asyncgrpo.server.self_check import SelfCheckError, check_engine

CPU = torch.device("cpu")


def _engine(model: torch.nn.Module, dtype: torch.dtype) -> tuple[ModelRunner, Scheduler]:
    """The server's engine parts around `model` (already set up for serving)."""
    c = model.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    cache = PagedKVCache(c.num_hidden_layers, 8, 16, c.num_key_value_heads, head_dim, dtype, CPU)
    scheduler = Scheduler(BlockAllocator(cache.num_blocks), 16, 4, 256, 128)
    return ModelRunner(model, cache, CPU, c.vocab_size, scheduler.block_table), scheduler


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_tiny_model_passes_in_well_under_a_second(dtype):
    served = load_served_model(TINY, CPU, str(dtype).removeprefix("torch."), 256)
    runner, scheduler = _engine(served.model, dtype)
    t0 = time.perf_counter()
    result = check_engine(runner, scheduler, served.model, vocab_size=served.vocab_size, dtype=dtype, device=CPU,
                          name=TINY)
    assert time.perf_counter() - t0 < 1.0
    assert result.num_compared == 9 * 6 and result.max_abs_diff <= result.tolerance / 10
    assert not scheduler.has_work()  # the check leaves the engine as it found it


def _mistral(sliding_window: int | None) -> torch.nn.Module:
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    config = MistralConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=128,
                           sliding_window=sliding_window)
    model = MistralForCausalLM(config).eval().requires_grad_(False)
    model.set_attn_implementation(register_attention())
    fuse_layers(model, triton=False)
    return model


def test_a_sliding_window_the_engine_ignores_is_caught_and_full_attention_passes():
    model = _mistral(sliding_window=4)  # the paged attention attends to the whole context
    with pytest.raises(SelfCheckError, match="does not compute what the model computes.*serve it with vLLM"):
        check_engine(*_engine(model, torch.float32), model, vocab_size=128, dtype=torch.float32, device=CPU,
                     name="mistral-sw4")
    model = _mistral(sliding_window=None)
    assert check_engine(*_engine(model, torch.float32), model, vocab_size=128, dtype=torch.float32, device=CPU,
                        name="mistral").max_abs_diff < 1e-4


def test_serve_refuses_a_soft_capped_gemma2_with_a_message(tmp_path):
    """Gemma 2's attention soft-capping is ignored by the paged attention: `asyncgrpo serve` must exit
    with the self-check's message instead of serving it."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    torch.manual_seed(0)
    config = Gemma2Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=128,
                          attn_logit_softcapping=0.5, final_logit_softcapping=None, initializer_range=0.5,
                          layer_types=["full_attention"] * 2, sliding_window=4096)
    Gemma2ForCausalLM(config).save_pretrained(tmp_path / "gemma2")
    proc = subprocess.run([sys.executable, "-m", "asyncgrpo.cli", "serve", str(tmp_path / "gemma2"),
                           "--port", str(free_port())], capture_output=True, text=True, timeout=90, check=False)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "does not compute what the model computes" in proc.stderr and "Traceback" not in proc.stderr
