"""RMSNorm in one Triton kernel for the served model's norm layers (CUDA).

The Hugging Face RMSNorm of Llama-style models (Llama, Qwen2/3, Mistral, ...) is eight small
kernels (upcast, square, mean, add, rsqrt, multiply, downcast, scale); a Qwen3 layer has four of
them, so at small decode batches, where every kernel costs a few microseconds whatever its size,
they are about half of the forward pass. `fuse_rms_norms` gives each such module a forward that
runs one kernel with the same arithmetic (float32 statistics, the normalised value rounded to the
input dtype before the scale), after checking on random input that it is as accurate as the
module's own forward (`as_accurate`): a norm of another definition (Gemma's `1 + weight`, say)
keeps its own forward.
"""

from __future__ import annotations

import copy
import functools
import logging
from collections.abc import Callable

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


def as_accurate(module: torch.nn.Module, forward: Callable, *inputs) -> bool:
    """Whether `forward` computes the module's function as accurately as the module's own forward,
    both measured against the module run in float32 on the same inputs. The load-time check of every
    swapped forward (here and in `fused_layers.py`): in half precision, rounding alone can move a
    sharp attention's output past a fixed tolerance, while another definition (a scale of 1 + weight,
    another activation) is off by far more than the module's own rounding."""

    def first(out):
        return out[0] if isinstance(out, tuple) else out

    def upcast(x):
        return tuple(map(upcast, x)) if isinstance(x, tuple) else x.float() if torch.is_tensor(x) else x

    with torch.no_grad():
        own, got = first(module(*inputs)), first(forward(*inputs))
        exact = first(copy.deepcopy(module).float()(*map(upcast, inputs)))
    if got.dtype != own.dtype or got.shape != own.shape:
        return False

    def error(y: torch.Tensor) -> float:
        return ((y.float() - exact).norm() / exact.norm().clamp_min(1e-30)).item()

    # the floor: float32 sums in another order (merged matmuls, one-kernel reductions)
    return error(got) <= 2 * error(own) + 1e-5


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
        forward = functools.partial(_fused_forward, module)
        g = torch.Generator(device=weight.device).manual_seed(0)
        x = torch.randn(5, weight.shape[0], generator=g, device=weight.device).to(weight.dtype)
        try:
            same = as_accurate(module, forward, x)
        except Exception as exc:  # noqa: BLE001 -- a compile or launch failure: the rest keep their forward
            logger.warning("the one-kernel RMSNorm does not run on this GPU (%s); norm layers keep their own "
                           "forward", exc)
            break
        if same:
            module.forward = forward
            fused += 1
        else:
            kept.add(type(module).__name__)
    if kept:
        logger.info("norm layers %s compute another function than rms_norm: they keep their own forward",
                    kept)
    return fused
