"""The trainer's fast paths, chosen once at start: compiled decoder layers (and with them the fused
log-prob head) and FlashAttention-4 for the tree attention.

`torch_compile=None` (the default) means "where it runs": on one CUDA process the layers are compiled
and a probe checks them before training; the eager layers stay on CPU, under FSDP (the model is
sharded after this point) and wherever the probe fails. `flex_attention_backend="auto"` (the default)
picks FlashAttention-4 where the layers are compiled, the GPU is a Hopper or later and the
`flash-attn-4` package imports; FlexAttention's own Triton kernels otherwise. An explicit True/False
or "triton"/"flash" is obeyed without a probe (and refused early where it cannot run).

The probe: one packed row of two completions of a shared prompt, long enough for the CUDA path's
FlexAttention masks (`TreeMask.from_row`'s `min_flex_tokens`), forward and backward through the model
and its log-prob head, compiled against eager, on the training device and autocast dtype, in train mode
and under activation checkpointing when the run has it. It compiles the graphs training uses (dynamic
row length; the flash path's masks padded to the token budget), so its time is the run's one-time
compile cost, which it reports. A probe that raises or disagrees
turns the fast path off with a warning saying why.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from asyncgrpo.packing.attention import TreeMask, tree_attention_context
from asyncgrpo.packing.tree import pack_row
from asyncgrpo.train.compiled_layers import (
    compile_decoder_layers,
    decoder_layers,
    flash_attention_problem,
    flex_backend_options,
)
from asyncgrpo.train.logprobs import token_logprobs
from asyncgrpo.train.model_setup import hidden_states_and_head
from asyncgrpo.train.waiting import notice_while_waiting
from asyncgrpo.types import Sample

logger = logging.getLogger(__name__)

# compiled against eager in the autocast dtype: relative error of the hidden states and log-probs, and
# cosine similarity of the gradients (bf16 rounding differs between fused and unfused kernels; a wrong
# kernel is off by far more)
PROBE_RTOL = 0.05
PROBE_MIN_GRAD_COSINE = 0.99
# inductor's FlexAttention lowering refuses smaller query/key/value dimensions
MIN_COMPILED_HEAD_DIM = 16
# a probe that compiles takes tens of seconds: say so after this long (and every 30 s)
PROBE_NOTICE_AFTER_S = 5.0
PROBE_PROMPT_TOKENS = 384
PROBE_COMPLETION_TOKENS = 160


@dataclass(frozen=True)
class FastPaths:
    """What the trainer runs: compiled layers (and fused log-prob head), the tree attention's kernel
    options (None: FlexAttention's Triton kernels), and the probe's seconds and its differences from
    the eager path (None: no probe ran)."""

    compiled: bool
    flex_options: dict | None
    probe_s: float | None = None
    probe_differences: dict[str, float] | None = None

    def describe(self) -> str:
        layers = ("compiled decoder layers and fused log-prob head" if self.compiled
                  else "eager decoder layers")
        attention = "FlashAttention-4" if self.flex_options else "FlexAttention (Triton)"
        probe = "" if self.probe_s is None else f"; start-up probe, compile included: {self.probe_s:.1f} s"
        if self.probe_differences:
            found = ", ".join(f"{k} {v:.3g}" for k, v in self.probe_differences.items())
            probe += f" (against eager: {found})"
        return f"{layers}, {attention} tree attention on CUDA{probe}"


def auto_compiles(device: torch.device, *, fsdp: bool) -> bool:
    """Where `torch_compile=None` compiles: one CUDA process's model, not yet sharded."""
    return device.type == "cuda" and not fsdp


def compiled_attention_problem(model: torch.nn.Module) -> str | None:
    """Why FlexAttention's compiled kernels cannot run this model's attention (None: no known reason)."""
    config = model.config.get_text_config()
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    if head_dim < MIN_COMPILED_HEAD_DIM:
        return (f"its head dimension, {head_dim}, is below the {MIN_COMPILED_HEAD_DIM} that FlexAttention's "
                "compiled kernels take")
    return None


def check_explicit_backend(args: Any) -> None:
    """Before anything loads: an explicit flex_attention_backend="flash" that cannot run is refused."""
    if args.flex_attention_backend == "flash":
        flex_backend_options("flash", args.device)


def choose_fast_paths(model: torch.nn.Module, args: Any, *, fsdp: bool,
                      compiles: Callable[[torch.device], bool] | None = None) -> FastPaths:
    """Compile the layers in place where asked or where "auto" finds it runs, and pick the attention
    kernels. `compiles(device)`: where torch_compile=None compiles (default `auto_compiles`)."""
    device = torch.device(args.device)
    requested = args.torch_compile
    auto = requested is None
    if auto:
        compile_it = compiles(device) if compiles is not None else auto_compiles(device, fsdp=fsdp)
        problem = compiled_attention_problem(model) if compile_it else None
        if problem is not None:  # known to fail: no probe, no warning, the eager layers
            logger.info("torch_compile=None (auto): the decoder layers stay eager: %s", problem)
            compile_it = False
    else:
        compile_it = bool(requested)
    backend = args.flex_attention_backend
    if backend == "auto":
        problem = "the decoder layers are not compiled" if not compile_it else flash_attention_problem(device)
        backend = "triton" if problem else "flash"
        if problem and compile_it:
            logger.info("flex_attention_backend='auto': FlexAttention's Triton kernels, not FlashAttention-4 "
                        "(%s)", problem)
    options = flex_backend_options(backend, device)
    if not compile_it:
        return FastPaths(False, options)
    compile_decoder_layers(model, backend=args.torch_compile_backend, mode=args.torch_compile_mode,
                           activation_memory_budget=args.activation_memory_budget)
    if not auto:
        return FastPaths(True, options)
    # the flash kernels first where "auto" chose them, then the Triton ones
    tries = [options] + ([None] if options is not None and args.flex_attention_backend == "auto" else [])
    failures = []
    for kernel_options in tries:
        started = time.perf_counter()
        try:
            with checkpointed_as_in_training(model, args), notice_while_waiting(
                lambda waited: f"torch_compile=None (auto): compiling the decoder layers and checking them "
                f"against the eager ones, once per run ({waited:.0f} s so far; torch_compile=False skips it)",
                first_after_s=PROBE_NOTICE_AFTER_S, every_s=30.0,
            ):
                differences = probe_compiled_layers(model, device, token_budget=args.token_budget,
                                                    kernel_options=kernel_options,
                                                    autocast_dtype=_autocast_dtype(args))
        except Exception as exc:  # any failure of the fast path: say it, and train on the path that works
            # its first lines: a compiler's error goes on to dump whole graphs
            lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
            failures.append(f"{'FlashAttention-4' if kernel_options else 'Triton'} kernels: "
                            f"{type(exc).__name__}: {' '.join(lines[:2])[:500]}")
            continue
        return FastPaths(True, kernel_options, round(time.perf_counter() - started, 2), differences)
    uncompile_decoder_layers(model)
    if args.flex_attention_backend == "flash":
        raise RuntimeError("flex_attention_backend='flash' runs in the compiled layers, and they failed the "
                           f"start-up probe ({'; '.join(failures)}): set flex_attention_backend='triton' "
                           "or 'auto'")
    logger.warning("torch_compile=None (auto): the compiled decoder layers failed the start-up probe, so "
                   "training runs the eager layers (%s). Set torch_compile=False to skip the probe, or "
                   "report the error with your model and torch versions.", "; ".join(failures))
    return FastPaths(False, None)


@contextlib.contextmanager
def checkpointed_as_in_training(model: torch.nn.Module, args: Any):
    """Activation checkpointing on, as the Trainer will turn it on in train() when the run has it: the
    layers compile a different graph under it (so the probe compiles the one training uses), and its
    recompute inside backward is part of what the probe checks. Off again afterwards."""
    # the run's setting under either name (newer transformers renamed the training argument and the
    # model's methods), the model's methods under the name its transformers has
    wanted = getattr(args, "activation_checkpointing", None) or getattr(args, "gradient_checkpointing", None)
    kwargs = dict(getattr(args, "activation_checkpointing_kwargs", None)
                  or getattr(args, "gradient_checkpointing_kwargs", None) or {})
    name = "activation_checkpointing" if hasattr(model, "activation_checkpointing_enable") else \
        "gradient_checkpointing"
    if not wanted or not hasattr(model, f"{name}_enable") or getattr(model, f"is_{name}", True):
        yield
        return
    layout = {k: kwargs.pop(k) for k in ("every_n_layers", "offload") if k in kwargs}  # not checkpoint()'s
    getattr(model, f"{name}_enable")(**{f"{name}_kwargs": kwargs or None}, **layout)
    try:
        yield
    finally:
        getattr(model, f"{name}_disable")()


def uncompile_decoder_layers(model: torch.nn.Module) -> None:
    """Undo `compile_decoder_layers`: each layer calls its eager forward again."""
    for layer in decoder_layers(model):
        layer._compiled_call_impl = None


@contextlib.contextmanager
def _eager_layers(model: torch.nn.Module):
    layers = decoder_layers(model)
    compiled = [layer._compiled_call_impl for layer in layers]
    for layer in layers:
        layer._compiled_call_impl = None
    try:
        yield
    finally:
        for layer, impl in zip(layers, compiled, strict=True):
            layer._compiled_call_impl = impl


def probe_row(vocab_size: int, seed: int = 0):
    """Two completions of one prompt, tree-packed: PROBE_PROMPT_TOKENS + 2 * PROBE_COMPLETION_TOKENS."""
    rng = np.random.default_rng(seed)
    high = min(vocab_size, 32_000)
    prompt = rng.integers(0, high, PROBE_PROMPT_TOKENS)
    samples = []
    for i in range(2):
        completion = rng.integers(0, high, PROBE_COMPLETION_TOKENS)
        completion[0] = i  # the completions part right after the prompt
        tokens = np.concatenate([prompt, completion])
        trained = np.zeros(len(tokens), dtype=bool)
        trained[PROBE_PROMPT_TOKENS:] = True
        samples.append(Sample(token_ids=tokens, trained_mask=trained, sampler_logprobs=np.zeros(len(tokens),
                              dtype=np.float32), advantage=1.0 - 2.0 * i, group_id=0))
    return pack_row(samples)


def probe_compiled_layers(model: torch.nn.Module, device: torch.device | str, *, token_budget: int | None,
                          kernel_options: dict | None, autocast_dtype: torch.dtype | None,
                          rtol: float = PROBE_RTOL, min_grad_cosine: float = PROBE_MIN_GRAD_COSINE,
                          ) -> dict[str, float]:
    """Raise unless the compiled layers (already compiled in place) and the fused log-prob head give what
    the eager ones give on one packed row: forward, log-probs and gradients. Returns the differences
    (relative ones of the hidden states and log-probs, the largest log-prob difference, the gradients'
    cosine). Moves the model to `device` (where the Trainer puts it next) and leaves no gradient."""
    device = torch.device(device)
    model.to(device)
    row = probe_row(model.config.get_text_config().vocab_size).to(device)
    capacity = max(token_budget or 0, row.num_tokens) if kernel_options else None
    was_training = model.training
    model.train()
    try:
        with _eager_layers(model):
            want = _forward_backward(model, row, capacity, kernel_options, autocast_dtype, fused=False)
        got = _forward_backward(model, row, capacity, kernel_options, autocast_dtype, fused=True)
    finally:
        model.train(was_training)
        model.zero_grad(set_to_none=True)
    differences = {}
    for name in ("hidden", "logprobs"):
        error = _relative_error(got[name], want[name])
        if not error <= rtol:  # also catches NaN
            raise AssertionError(f"compiled {name} differ from eager ones by {error:.3g} (relative; at most "
                                 f"{rtol} expected)")
        differences[f"{name}_relative"] = error
    differences["logprob_max_abs"] = (got["logprobs"] - want["logprobs"]).abs().max().item()
    cosine = torch.nn.functional.cosine_similarity(got["grad"], want["grad"], dim=0).item()
    if not cosine >= min_grad_cosine:
        raise AssertionError(f"compiled gradients point elsewhere than eager ones (cosine {cosine:.4f}, at "
                             f"least {min_grad_cosine} expected)")
    differences["grad_cosine"] = cosine
    return differences


def _forward_backward(model, row, capacity, kernel_options, autocast_dtype, *, fused: bool) -> dict:
    model.zero_grad(set_to_none=True)
    mask = TreeMask.from_row(row, row.input_ids.device, mask_capacity=capacity, kernel_options=kernel_options)
    autocast = (torch.autocast(row.input_ids.device.type, dtype=autocast_dtype) if autocast_dtype is not None
                else contextlib.nullcontext())
    torch.manual_seed(0)
    with autocast, tree_attention_context(mask):
        hidden, head, _ = hidden_states_and_head(model, row.input_ids, row.position_ids)
        logprobs = token_logprobs(hidden, head.weight, row.pred_index, row.target_ids, fused=fused)
        loss = -(logprobs.target_logprobs * row.advantages).mean()
    loss.backward()
    grads = [p.grad.detach().float().flatten() for p in model.parameters() if p.grad is not None]
    return {
        "hidden": hidden.detach().float(),
        "logprobs": logprobs.target_logprobs.detach().float(),
        "grad": torch.cat(grads) if grads else torch.zeros(1, device=row.input_ids.device),
    }


def _relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    scale = want.abs().max().clamp_min(1e-6)
    return ((got - want).abs().max() / scale).item()


def _autocast_dtype(args: Any) -> torch.dtype | None:
    if getattr(args, "bf16", False):
        return torch.bfloat16
    if getattr(args, "fp16", False):
        return torch.float16
    return None
