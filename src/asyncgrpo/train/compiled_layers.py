"""`torch.compile` of each decoder layer, in place, for tree-packed rows (`torch_compile=True`).

A decoder layer is where a training step's time goes: its matmuls, and around them a few dozen
memory-bound kernels (RMSNorm in fp32, rotary, SiLU and the gating product, residual adds, casts)
that eager PyTorch runs one by one over the whole row. Inductor fuses those into a handful of
kernels; the matmuls stay cuBLAS calls and the tree attention becomes FlexAttention inside the graph.
Compiling the whole model instead would trace the hooks that hand the row to the layers, the
chunked LM head and the Trainer's wrappers, for nothing.

- In place (`Module.compile`): parameter names do not change (weight sync, checkpoints), and
  gradient checkpointing stays outside the compiled region (a recomputation reruns the compiled
  forward). All layers share one graph: same code, parameters passed as inputs.
- Shapes: the row length is dynamic from the first compile (`dynamic=True`), so rows of any length
  reuse one graph. Padding rows to length buckets would cost compute for nothing: the tree mask makes
  the graph independent of the row's layout, and only the length varies.
- Recomputation: under whole-layer gradient checkpointing a layer's backward reruns its compiled
  forward. With `activation_memory_budget` there is no checkpointing; the partitioner that splits each
  compiled layer into forward and backward keeps at most that fraction of the activations and
  recomputes the cheapest operations (elementwise, norms) for the rest, keeping matmul outputs.
- Masks: a forward pre-hook on the model builds the row's attention masks for every window the
  layers use (`TreeMask.prebuild`) before the first layer runs, so no graph builds a mask and every
  layer reads the same one.
- Attention kernels (`flex_attention_backend`): FlexAttention's Triton kernels, or its FlashAttention-4
  backend, which refuses a mask that captures a symbolic size: the rows' masks then read tensors padded
  to the token budget (`TreeMask.mask_capacity`). The masks carry the choice (`TreeMask.kernel_options`),
  so checkpointing's recomputation inside backward runs the forward's kernels.
"""

from __future__ import annotations

import logging

import torch
from torch._functorch import config as functorch_config

from asyncgrpo.packing.attention import active_tree_mask, attention_windows
from asyncgrpo.train.model_setup import decoder_and_head, unwrap

logger = logging.getLogger(__name__)

__all__ = ["compile_decoder_layers", "decoder_layers", "flex_backend_options"]

_PREBUILD_HOOK = "_asyncgrpo_prebuild_masks_hook"


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated blocks of the model's decoder (the classes transformers lists in
    `_no_split_modules`), in order; the decoder's `layers` list where the model names none."""
    base = unwrap(model)
    body, _ = decoder_and_head(model)
    names = set(getattr(base, "_no_split_modules", None) or ())
    layers = [m for m in body.modules() if type(m).__name__ in names]
    if not layers and isinstance(getattr(body, "layers", None), torch.nn.ModuleList):
        layers = list(body.layers)
    if not layers:
        raise ValueError(f"{type(base).__name__} exposes no decoder layers to compile (neither "
                         "`_no_split_modules` nor a `layers` list); set torch_compile=False")
    return layers


def compile_decoder_layers(model: torch.nn.Module, *, backend: str | None = "inductor",
                           mode: str | None = None, dynamic: bool | None = True,
                           activation_memory_budget: float | None = None) -> int:
    """Compile every decoder layer in place and prebuild each row's masks before the layers run;
    returns the number of layers compiled. Call once, after `enable_tree_attention`.
    `activation_memory_budget` (0, 1]: the partitioner's budget, set for the whole process (the layers'
    forward/backward split happens when they first run in training, later than this call)."""
    base = unwrap(model)
    body, _ = decoder_and_head(model)
    windows = attention_windows(base)
    layers = decoder_layers(model)
    # transformers' attention modules set a context variable of the `kernels` package in their forward (how
    # it routes kernelized functions); under activation checkpointing dynamo refuses that side effect and
    # runs the whole layer eagerly, unless the backward's recompute may skip it (it only routes calls)
    if hasattr(torch._dynamo.config, "skip_fwd_side_effects_in_bwd_under_checkpoint"):
        torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint = True
    if activation_memory_budget is not None:
        functorch_config.activation_memory_budget = activation_memory_budget
    for layer in layers:
        layer.compile(backend=backend or "inductor", mode=mode, dynamic=dynamic)
    if getattr(body, _PREBUILD_HOOK, None) is None:  # the decoder runs the layers, however it is called
        def prebuild(module, args, kwargs):
            mask = active_tree_mask()
            if mask is not None:
                mask.prebuild(windows)

        setattr(body, _PREBUILD_HOOK, body.register_forward_pre_hook(prebuild, with_kwargs=True))
    logger.info("compiled %d decoder layers of %s (backend %s, mode %s, dynamic row length%s); masks of "
                "windows %s are built before the layers", len(layers), type(base).__name__, backend, mode,
                "" if activation_memory_budget is None
                else f", activation memory budget {activation_memory_budget}",
                windows)
    return len(layers)


def flash_attention_problem(device: torch.device | str) -> str | None:
    """Why FlashAttention-4 cannot run the tree attention on `device` (None: it can)."""
    found = _flash_attention_problem(device)
    return None if found is None else found[1]


def _flash_attention_problem(device: torch.device | str) -> tuple[type[Exception], str] | None:
    """FlashAttention-4 needs a Hopper or Blackwell GPU and the flash-attn-4 package."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return ValueError, (f"this process trains on {device}" if device.type != "cuda"
                            else "this process has no CUDA device")
    major, minor = torch.cuda.get_device_capability(device)
    if major < 9:
        return ValueError, (f"FlashAttention-4 runs on Hopper or Blackwell GPUs (compute capability 9.0 or "
                            f"later), and {torch.cuda.get_device_name(device)} is {major}.{minor}")
    try:
        import flash_attn.cute  # noqa: F401 -- FlexAttention imports it when it lowers the FLASH backend
    except ImportError as exc:
        return ImportError, f"the flash-attn-4 package is missing ({exc}): pip install flash-attn-4"
    return None


def flex_backend_options(backend: str, device: torch.device | str) -> dict | None:
    """FlexAttention's kernel_options for the tree attention's `backend`, "triton" (None: its own Triton
    kernels) or "flash" (FlashAttention-4), checked: a "flash" that cannot run is refused with the fix."""
    if backend == "triton":
        return None
    found = _flash_attention_problem(device)
    if found is not None:
        error, problem = found
        raise error(f"flex_attention_backend={backend!r} runs FlashAttention-4 on a CUDA GPU, and {problem}: "
                    "set flex_attention_backend='triton'")
    return {"BACKEND": "FLASH"}
