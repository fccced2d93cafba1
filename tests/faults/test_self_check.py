"""The embedded server refuses at load a model its engine would serve wrongly: the engine's log-probs
over a short prompt (prefill, then decode steps through the paged cache) are compared with the
model's own forward (item 8)."""

from __future__ import annotations

import pytest
import torch
from fault_helpers import TINY

from asyncgrpo.server.attention.plan import resolve_plan
from asyncgrpo.server.attention_math import kv_window
from asyncgrpo.server.fused_layers import fuse_layers
from asyncgrpo.server.kv_cache import PagedKVCache, register_attention
from asyncgrpo.server.loading import load_served_model
from asyncgrpo.server.prefix_cache import BlockPool
from asyncgrpo.server.runner import ModelRunner
from asyncgrpo.server.scheduler import Scheduler
from asyncgrpo.server.self_check import SelfCheckError, check_engine

pytestmark = pytest.mark.engine

CPU = torch.device("cpu")


def _engine(model: torch.nn.Module, dtype: torch.dtype) -> tuple[ModelRunner, Scheduler]:
    """The server's engine parts around `model` (already set up for serving)."""
    c = model.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    cache = PagedKVCache(c.num_hidden_layers, 8, 16, c.num_key_value_heads, head_dim, dtype, CPU)
    window = kv_window(model, range(c.num_hidden_layers))  # as the server: blocks behind a window are freed
    scheduler = Scheduler(BlockPool(cache.num_blocks), 16, 4, 256, 128, window=window)
    return ModelRunner(model, cache, resolve_plan(model, cache, CPU), c.vocab_size,
                       scheduler.block_table), scheduler


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_tiny_model_passes(dtype):
    served = load_served_model(TINY, CPU, str(dtype).removeprefix("torch."), 256)
    runner, scheduler = _engine(served.model, dtype)
    result = check_engine(runner, scheduler, served.model, vocab_size=served.vocab_size,
                          dtype=dtype, device=CPU, name=TINY)
    assert result.num_compared == 9 * 6 and result.max_abs_diff <= result.tolerance / 10
    assert not scheduler.has_work()  # the check leaves the engine as it found it


def _mistral(sliding_window: int | None) -> torch.nn.Module:
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    config = MistralConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                           max_position_embeddings=128, sliding_window=sliding_window)
    model = MistralForCausalLM(config).eval().requires_grad_(False)
    model.set_attn_implementation(register_attention())
    fuse_layers(model, triton=False)
    return model


def test_an_engine_that_computes_something_else_is_refused_and_sliding_windows_pass():
    """The engine honours Mistral's window (the check passes); a layer that computes differently under
    the engine (here: its output perturbed whenever the paged-cache metadata is passed, as an ignored
    attention option would) is refused with the message that names the fix."""
    model = _mistral(sliding_window=4)
    assert check_engine(*_engine(model, torch.float32), model, vocab_size=128,
                        dtype=torch.float32, device=CPU, name="mistral-sw4").max_abs_diff < 1e-4

    def perturb_under_the_engine(module, args, kwargs, output):
        if "kv_meta" in kwargs:
            hidden = output[0] if isinstance(output, tuple) else output
            hidden = hidden + 0.5 * torch.sin(torch.arange(hidden.shape[-1], dtype=hidden.dtype))
            return (hidden, *output[1:]) if isinstance(output, tuple) else hidden
        return output

    model = _mistral(sliding_window=None)
    model.model.layers[1].register_forward_hook(perturb_under_the_engine, with_kwargs=True)
    with pytest.raises(SelfCheckError, match="does not compute what the model computes.*serve it with vLLM"):
        check_engine(*_engine(model, torch.float32), model, vocab_size=128, dtype=torch.float32, device=CPU,
                     name="mistral-perturbed")


def test_a_soft_capped_gemma2_passes():
    """Gemma 2's attention soft-capping is applied by the engine: the check passes."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    torch.manual_seed(0)
    config = Gemma2Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                          max_position_embeddings=128,
                          attn_logit_softcapping=0.5, final_logit_softcapping=None, initializer_range=0.5,
                          layer_types=["full_attention"] * 2, sliding_window=4096)
    model = Gemma2ForCausalLM(config).eval().requires_grad_(False)
    model.set_attn_implementation(register_attention())
    fuse_layers(model, triton=False)
    assert check_engine(*_engine(model, torch.float32), model, vocab_size=128,
                        dtype=torch.float32, device=CPU, name="gemma2-softcap").max_abs_diff < 1e-4
