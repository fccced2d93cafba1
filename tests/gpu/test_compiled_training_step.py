"""The compiled training paths on CUDA (what `torch_compile=True` runs): the fused log-prob head's compiled
kernels against the plain path, and compiled decoder layers with FlexAttention tree masks against eager
layers (FlexAttention's Triton kernels, and its FlashAttention-4 backend where installed), forward and
backward, over rows of different lengths.

    pytest -m gpu tests/gpu/test_compiled_training_step.py
"""

from __future__ import annotations

import copy
import math
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from asyncgrpo.packing import pack_row
from asyncgrpo.packing.attention import (
    TreeMask,
    enable_tree_attention,
    tree_attention_context,
    tree_attention_forward,
)
from asyncgrpo.train.compiled_layers import compile_decoder_layers, flex_backend_options
from asyncgrpo.train.logprobs import token_logprobs

# the tiny models of test_tree_attention
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "packing"))

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("softcap", [None, 30.0])
def test_compiled_fused_head_matches_the_plain_path(softcap):
    g = torch.Generator(device="cuda").manual_seed(0)
    n, t, h, v, k = 3000, 3500, 256, 50_000, 4  # chunks of 1024: the last one shorter (dynamic length)
    hidden = torch.randn(t, h, device="cuda", generator=g).bfloat16().requires_grad_()
    weight = (torch.randn(v, h, device="cuda", generator=g) * 3 / math.sqrt(h)).bfloat16().requires_grad_()
    pred = torch.randint(0, t, (n,), device="cuda", generator=g)
    target = torch.randint(0, v, (n,), device="cuda", generator=g)
    topk = torch.randint(0, v, (n, k), device="cuda", generator=g)
    coef = torch.randn(n, device="cuda", generator=g)
    results = []
    for fused in (False, True):
        hidden.grad = weight.grad = None
        out = token_logprobs(hidden, weight, pred, target, temperature=0.7,
                             logit_softcapping=softcap, topk_ids=topk, fused=fused)
        ((out.target_logprobs * coef).sum() + out.topk_logprobs.sum()).backward()
        results.append((out.target_logprobs.detach(), out.topk_logprobs.detach(),
                        out.entropy, hidden.grad.float(), weight.grad.float()))
    for plain, fused in zip(*results):
        torch.testing.assert_close(fused, plain, atol=1e-3 + 2e-2 * float(plain.abs().max()), rtol=0)


def _flash_attention_4_runs() -> bool:
    try:
        flex_backend_options("flash", "cuda")
    except (ImportError, ValueError):
        return False
    return True


@pytest.mark.parametrize("backend", [
    "triton",
    # flex_attention_backend="flash": the masks' tensors padded to one capacity for rows of three lengths
    pytest.param("flash", marks=pytest.mark.skipif(not torch.cuda.is_available()
                                                   or not _flash_attention_4_runs(),
                                                   reason="needs the flash-attn-4 package and a Hopper or "
                                                          "Blackwell GPU")),
])
def test_compiled_layers_with_flex_masks_match_eager_layers(backend):
    import torch._dynamo
    from test_tree_attention import grpo_like_samples, tiny_model

    shape = {"hidden_size": 512, "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128,
             "layer_types": ["full_attention", "full_attention"], "use_sliding_window": False}
    eager = tiny_model("qwen3", **shape).cuda().to(torch.bfloat16).train()
    eager.config.use_cache = False
    eager.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    enable_tree_attention(eager)
    compiled = copy.deepcopy(eager)
    torch._dynamo.reset()  # no graph traced under another backend's kernel options is reused
    compile_decoder_layers(compiled)
    options = flex_backend_options(backend, "cuda")
    capacity = 2048 if options else None
    rng = np.random.default_rng(0)
    try:
        for num_sets in (6, 9, 12):  # rows of about 600 to 1200 tokens
            row = pack_row([s for _ in range(num_sets) for s in grpo_like_samples(rng)]).to("cuda")
            results = []
            for model, kernel_options, mask_capacity in ((eager, None, None), (compiled, options, capacity)):
                model.zero_grad()
                mask = TreeMask.from_row(row, mask_capacity=mask_capacity, kernel_options=kernel_options)
                with tree_attention_context(mask):
                    hidden = model.model(input_ids=row.input_ids[None], position_ids=row.position_ids[None])
                lp = token_logprobs(hidden.last_hidden_state[0], model.lm_head.weight, row.pred_index,
                                    row.target_ids).target_logprobs
                # outside the context, as a trainer's may be: the checkpointed layers recompute on the
                # mask's kernels (with FA4 options in a context around the forward only, the recomputation
                # ran Triton's and the gradients were wrong)
                lp.sum().backward()
                results.append((lp.detach(), model.model.embed_tokens.weight.grad.float().clone()))
            (lp_eager, grad_eager), (lp_compiled, grad_compiled) = results
            torch.testing.assert_close(lp_compiled, lp_eager, atol=3e-2, rtol=0)
            torch.testing.assert_close(grad_compiled, grad_eager,
                                       atol=3e-2 * float(grad_eager.abs().max()), rtol=0)
    finally:
        torch._dynamo.reset()


@pytest.mark.parametrize("backend", [
    "triton",
    pytest.param("flash", marks=pytest.mark.skipif(not torch.cuda.is_available()
                                                   or not _flash_attention_4_runs(),
                                                   reason="needs the flash-attn-4 package and a Hopper or "
                                                          "Blackwell GPU")),
])
@pytest.mark.parametrize("kv_heads", [8, 16])
# Gemma-2-like layers: a sliding window (the rows' trees are 24 tokens deep) and soft-capping
@pytest.mark.parametrize("window, softcap", [(None, None), (8, 10.0)])
def test_flex_attention_on_tree_masks_matches_a_float32_reference(backend, kv_heads, window, softcap):
    """The layers' tree attention on FlexAttention alone (`tree_attention_forward`), on tree masks (plain
    and padded to a capacity), forward and backward of q, k, v, against softmax attention in float32 on
    the dense mask: the kernel, apart from the layers around it."""
    from test_tree_attention import grpo_like_samples

    options = flex_backend_options(backend, "cuda")
    rng = np.random.default_rng(0)
    g = torch.Generator(device="cuda").manual_seed(0)
    for num_sets, capacity in ((6, None), (6, 2048), (9, 2048)):
        row = pack_row([s for _ in range(num_sets) for s in grpo_like_samples(rng)]).to("cuda")
        mask = TreeMask.from_row(row, backend="flex", mask_capacity=capacity, kernel_options=options)
        length = row.num_tokens
        q, k, v = (torch.randn(1, heads, length, 128, device="cuda", generator=g).bfloat16()
                   for heads in (16, kv_heads, kv_heads))
        q = q * 4  # scores of a few units, where soft-capping at 10 bends them
        grad_out = torch.randn(1, length, 16, 128, device="cuda", generator=g)
        results = []
        for run in ("flex", "reference"):
            cast = torch.float32 if run == "reference" else torch.bfloat16
            inputs = [t.detach().to(cast).requires_grad_() for t in (q, k, v)]
            if run == "flex":
                out, _ = tree_attention_forward(torch.nn.Module(), *inputs, None, tree_mask=mask,
                                                sliding_window=window, softcap=softcap)
            else:
                qf, kf, vf = inputs[0], *(t.repeat_interleave(16 // kv_heads, 1) for t in inputs[1:])
                scores = (qf @ kf.transpose(-1, -2)) * 128 ** -0.5
                if softcap is not None:
                    scores = torch.tanh(scores / softcap) * softcap
                out = (torch.softmax(scores.masked_fill(~mask.dense(window), float("-inf")), -1)
                       @ vf).transpose(1, 2)
            (out.float() * grad_out).sum().backward()
            results.append([out.detach().float()] + [t.grad.float() for t in inputs])
        for name, got, want in zip(("out", "dq", "dk", "dv"), *results):
            error = float((got - want).abs().max() / want.abs().max())
            assert error < 0.02, (f"{backend} {name}: relative error {error:.4f}, {length}-token row, "
                                  f"capacity {capacity}, window {window}, softcap {softcap}")
