"""Tests for asyncgrpo.train.compiled_layers: compiled decoder layers keep packed == unpacked, and rows of
new lengths reuse the compiled graphs."""

from __future__ import annotations

import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch
import torch._dynamo.utils

# the tiny models of tests/packing/test_tree_attention.py
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "packing"))
from test_tree_attention import grpo_like_samples, tiny_model, unpacked_logprobs

from asyncgrpo.packing import pack_row
from asyncgrpo.packing.attention import TreeMask, enable_tree_attention, tree_attention_context
from asyncgrpo.train.compiled_layers import compile_decoder_layers, decoder_layers, flex_backend_options
from asyncgrpo.train.logprobs import token_logprobs

pytestmark = pytest.mark.engine


def _train_model(compiled_backend: str | None):
    model = tiny_model("qwen3")  # one sliding-window and one full-attention layer
    model.train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    enable_tree_attention(model)
    if compiled_backend is not None:
        assert compile_decoder_layers(model, backend=compiled_backend) == 2
    return model


def _logprobs_and_grad(model, row):
    model.zero_grad()
    with tree_attention_context(TreeMask.from_row(row)):
        hidden = model.model(input_ids=row.input_ids[None],
                             position_ids=row.position_ids[None]).last_hidden_state
    lp = token_logprobs(hidden[0], model.lm_head.weight, row.pred_index, row.target_ids).target_logprobs
    lp.sum().backward()
    return lp.detach(), model.model.embed_tokens.weight.grad.clone()


def _check_against_eager(backend: str, num_rows: int) -> None:
    compiled, eager = _train_model(backend), _train_model(None)
    rng = np.random.default_rng(0)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    for n in range(1, num_rows + 1):  # rows of about 120, 230, 340 tokens
        samples = [s for _ in range(n) for s in grpo_like_samples(rng)]
        row = pack_row(samples)
        got_lp, got_grad = _logprobs_and_grad(compiled, row)
        want_lp, want_grad = _logprobs_and_grad(eager, row)
        torch.testing.assert_close(got_lp, want_lp, atol=1e-5, rtol=0)
        torch.testing.assert_close(got_grad, want_grad, atol=1e-5, rtol=1e-4)
        if n == 1:  # packed == unpacked: each sample alone through the model's own attention
            reference = tiny_model("qwen3")
            torch.testing.assert_close(got_lp, unpacked_logprobs(reference, samples), atol=1e-5, rtol=0)
    # one graph per attention window (sliding and full), whatever the row lengths
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 2


def test_compiled_layers_match_eager_and_do_not_recompile_per_row_length():
    _check_against_eager("aot_eager", num_rows=3)


def test_decoder_layers_are_the_repeated_blocks():
    model = tiny_model("qwen3")
    assert decoder_layers(model) == list(model.model.layers)


@pytest.mark.slow
@pytest.mark.parametrize("kernel_options", [None, {"PRESCALE_QK": False}])
def test_compiled_layers_read_flex_block_masks_of_any_row_length_from_one_graph(kernel_options):
    """The CUDA path's masks (FlexAttention BlockMask, forward on CPU): rows of 600 to 1300 tokens run
    through the same compiled graphs and keep packed == unpacked. The graphs are one, or two where the
    `kernels` package (transformers >= 5.2x) routes the attention module's functions through a variable
    that its first compiled call sets: the second call compiles once more, and no row length after it.
    Masks that carry kernel options (`flex_attention_backend`), each its own dict, reuse the graphs too."""
    full = {"layer_types": ["full_attention", "full_attention"], "use_sliding_window": False}
    model, reference = tiny_model("qwen3", **full), tiny_model("qwen3", **full)
    model.config.use_cache = False
    enable_tree_attention(model)
    compile_decoder_layers(model, backend="aot_eager")
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    rng = np.random.default_rng(0)
    graphs = []
    for n in (5, 7, 9, 11):
        samples = [s for _ in range(n) for s in grpo_like_samples(rng)]
        row = pack_row(samples)
        mask = TreeMask.from_row(row, backend="flex",
                                 kernel_options=dict(kernel_options) if kernel_options else None)
        with torch.no_grad(), tree_attention_context(mask):
            hidden = model.model(input_ids=row.input_ids[None],
                                 position_ids=row.position_ids[None]).last_hidden_state
            lp = token_logprobs(hidden[0], model.lm_head.weight, row.pred_index,
                                row.target_ids).target_logprobs
        torch.testing.assert_close(lp, unpacked_logprobs(reference, samples), atol=1e-5, rtol=0)
        graphs.append(torch._dynamo.utils.counters["stats"]["unique_graphs"])
    assert graphs[1] == graphs[-1] <= 2, graphs


@pytest.mark.slow
def test_a_mask_capacity_leaves_no_symbolic_size_in_the_compiled_mask_function():
    """With `mask_capacity` the mask function of layers compiled for any row length reads tensors of a
    static size: its captured inputs hold no SymInt (FlexAttention's FLASH backend refuses one), and
    rows of two lengths still run through one graph with packed == unpacked."""
    full = {"layer_types": ["full_attention", "full_attention"], "use_sliding_window": False}
    model, reference = tiny_model("qwen3", **full), tiny_model("qwen3", **full)
    model.config.use_cache = False
    enable_tree_attention(model)
    captured = []

    def backend(gm, example_inputs):
        for node in gm.graph.nodes:
            if node.op == "call_function" and "flex_attention" in str(node.target):
                captured.append([type(a.meta.get("example_value")).__name__ for a in node.args[-1]])
        return gm.forward

    compile_decoder_layers(model, backend=backend)
    torch._dynamo.reset()
    rng = np.random.default_rng(0)
    for capacity in (None, 2048):
        for n in (5, 7):
            samples = [s for _ in range(n) for s in grpo_like_samples(rng)]
            row = pack_row(samples)
            mask = TreeMask.from_row(row, backend="flex", mask_capacity=capacity)
            with torch.no_grad(), tree_attention_context(mask):
                hidden = model.model(input_ids=row.input_ids[None],
                                     position_ids=row.position_ids[None]).last_hidden_state
                lp = token_logprobs(hidden[0], model.lm_head.weight, row.pred_index,
                                    row.target_ids).target_logprobs
            torch.testing.assert_close(lp, unpacked_logprobs(reference, samples), atol=1e-5, rtol=0)
        torch._dynamo.reset()
    without, with_capacity = captured[0], captured[-1]
    assert "SymInt" in without  # the row length, lifted with the mask's per-token tensor
    assert "SymInt" not in with_capacity and "FakeTensor" in with_capacity
    with pytest.raises(ValueError, match="mask_capacity=16 is below"):
        TreeMask.from_row(row, backend="flex", mask_capacity=16)


def test_the_triton_backend_needs_no_kernel_options_and_flash_is_refused_off_a_gpu_with_the_fix():
    assert flex_backend_options("triton", "cpu") is None
    with pytest.raises(ValueError) as info:
        flex_backend_options("flash", "cpu")
    assert "trains on cpu" in str(info.value) and "flex_attention_backend='triton'" in str(info.value)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="has no CUDA device"):
            flex_backend_options("flash", "cuda")


def test_flash_on_a_pre_hopper_gpu_or_without_the_package_says_what_to_do(monkeypatch):
    import builtins

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100")
    with pytest.raises(ValueError) as info:
        flex_backend_options("flash", "cuda:0")
    assert "NVIDIA A100 is 8.0" in str(info.value) and "9.0 or later" in str(info.value)

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    real_import = builtins.__import__

    def no_flash_attn(name, *args, **kwargs):
        if name.startswith("flash_attn"):
            raise ImportError(f"No module named {name!r}")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_flash_attn)
    with pytest.raises(ImportError) as info:
        flex_backend_options("flash", "cuda:0")
    assert "pip install flash-attn-4" in str(info.value)
    monkeypatch.setattr(builtins, "__import__", real_import)
    for name in ("flash_attn", "flash_attn.cute"):  # an installed package, as far as the check can tell
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    assert flex_backend_options("flash", "cuda:0") == {"BACKEND": "FLASH"}
