"""RMSNorm in one Triton kernel for the served model's norm layers (CUDA).

The Hugging Face RMSNorm of Llama-style models (Llama, Qwen2/3, Mistral, ...) is eight small
kernels (upcast, square, mean, add, rsqrt, multiply, downcast, scale); a Qwen3 layer has four of
them, so at small decode batches, where every kernel costs a few microseconds whatever its size,
they are about half of the forward pass. `fuse_rms_norms` gives each such module a forward that
runs one kernel with the same arithmetic (float32 statistics, the normalised value rounded to the
input dtype before the scale), after checking on random input that the module computes exactly
that: a norm of another definition (Gemma's `1 + weight`, say) keeps its own forward.
"""

from __future__ import annotations

import functools
import logging

import torch

logger = logging.getLogger(__name__)


@functools.cache
def _triton_kernel():
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None

    @triton.jit
    def rms_norm_kernel(x_ptr, w_ptr, out_ptr, stride_x, stride_o, n_cols, eps, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        mask = cols < n_cols
        x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
        xf = x.to(tl.float32)
        rstd = tl.rsqrt(tl.sum(xf * xf, axis=0) / n_cols + eps)
        normed = (xf * rstd).to(x.dtype)  # HF: hidden_states.to(input_dtype) before the scale
        w = tl.load(w_ptr + cols, mask=mask, other=0.0)
        out = normed.to(tl.float32) * w.to(tl.float32)
        tl.store(out_ptr + row * stride_o + cols, out.to(out_ptr.dtype.element_ty), mask=mask)

    return rms_norm_kernel


def triton_available() -> bool:
    return _triton_kernel() is not None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * (x / sqrt(mean(x^2) + eps)).to(x.dtype) over the last dimension, in one kernel."""
    kernel = _triton_kernel()
    if kernel is None:
        raise RuntimeError("rms_norm needs Triton (it ships with PyTorch's CUDA wheels)")
    n = x.shape[-1]
    rows = x.reshape(-1, n)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(rows.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    kernel[(rows.shape[0],)](rows, weight, out, rows.stride(0), out.stride(0), n, eps,
                             BLOCK=max(16, 1 << (n - 1).bit_length()))
    return out.view(*x.shape[:-1], n)


def _fused_forward(module: torch.nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    return rms_norm(hidden_states, module.weight, module.variance_epsilon)


def _computes_rms_norm(module: torch.nn.Module) -> bool:
    """Whether the module computes `rms_norm` (checked on random input, to within a few roundings:
    what it tells apart are other definitions, such as a scale of 1 + weight)."""
    weight = module.weight
    g = torch.Generator(device=weight.device).manual_seed(0)
    x = torch.randn(5, weight.shape[0], generator=g, device=weight.device).to(weight.dtype)
    with torch.no_grad():
        expected = module(x)
        got = rms_norm(x, weight, module.variance_epsilon)
    return expected.dtype == got.dtype and torch.allclose(expected.float(), got.float(), rtol=3e-2, atol=1e-2)


def fuse_rms_norms(model: torch.nn.Module) -> int:
    """Give every RMSNorm module of `model` (on CUDA) the one-kernel forward; returns how many."""
    if _triton_kernel() is None:
        return 0
    fused, kept = 0, set()
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if not (
            type(module).__name__.endswith("RMSNorm")
            and isinstance(weight, torch.Tensor)
            and weight.dim() == 1
            and weight.is_cuda
            and isinstance(getattr(module, "variance_epsilon", None), float)
        ):
            continue
        try:
            same = _computes_rms_norm(module)
        except Exception as exc:  # noqa: BLE001 -- a compile or launch failure: the rest keep their forward
            logger.warning("the one-kernel RMSNorm does not run on this GPU (%s); norm layers keep their own "
                           "forward", exc)
            break
        if same:
            module.forward = functools.partial(_fused_forward, module)
            fused += 1
        else:
            kept.add(type(module).__name__)
    if kept:
        logger.info("norm layers %s compute another function than rms_norm: they keep their own forward", kept)
    return fused
