"""Gated DeltaNet layers of hybrid models (Qwen3.5, Qwen3.5-MoE, Qwen3-Next) on tree-packed rows.

A hybrid model interleaves full-attention layers (tree attention, `attention.py`) with Gated
DeltaNet layers, which mix tokens through a causal convolution and a linear recurrence instead.
`enable_tree_deltanet` wraps the forward of each such layer: while a packed row is forwarded (the
`tree_mask` keyword argument the tree-attention hook adds to the model's call, which transformers
passes down to every decoder layer and which gradient checkpointing replays), the layer runs
`tree_deltanet_forward`; without a row it runs its own forward unchanged.

`tree_deltanet_forward` is the layer's forward with the two token-mixing steps swapped for their
trie-following versions (`recurrent.py`): the projections, gates, gated norm and output projection
are the layer's own modules (`modeling/deltanet/layer.py`, shared with the embedded server), so the
result equals forwarding each sample alone.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from asyncgrpo.modeling.deltanet.layer import (
    DELTANET_CLASSES,
    delta_rule_inputs,
    deltanet_layers,
    deltanet_output,
    deltanet_projections,
)
from asyncgrpo.packing.recurrent import (
    DeltaRuleShape,
    resolve_delta_rule_backend,
    tree_causal_conv1d,
    tree_gated_delta_rule,
)

if TYPE_CHECKING:
    from asyncgrpo.packing.attention import TreeMask

logger = logging.getLogger(__name__)

__all__ = ["disable_tree_deltanet", "enable_tree_deltanet", "tree_deltanet_forward"]

_ORIGINAL_FORWARD = "_asyncgrpo_original_forward"
_MASK_KWARG = "tree_mask"  # the keyword the tree-attention hook adds (attention.py)


def enable_tree_deltanet(
    model: torch.nn.Module, expected: int, active_row: Callable[[], object | None]
) -> None:
    """Give every Gated DeltaNet layer its tree-packed forward; `expected` is the number of
    `linear_attention` layers the config declares (a mismatch means an unverified layer class);
    `active_row()` is the row being forwarded, if any (`tree_attention_context`)."""
    layers = deltanet_layers(model)
    if len(layers) != expected:
        names = sorted({type(m).__name__ for m in model.modules()
                        if hasattr(m, "A_log") and hasattr(m, "conv1d")})
        raise ValueError(f"the config declares {expected} linear-attention layers but {len(layers)} are "
                         f"Gated DeltaNet layers that tree packing runs (found: {names or 'none'}; verified: "
                         f"{sorted(DELTANET_CLASSES)})")
    for layer in layers:
        if not (hasattr(layer, "in_proj_qkvz") or hasattr(layer, "in_proj_qkv")):
            raise ValueError(f"{type(layer).__name__} has neither in_proj_qkv (Qwen3.5) nor in_proj_qkvz "
                             "(Qwen3-Next) projections; this transformers version lays the layer out "
                             "differently from the one tree packing was verified with (transformers >= 5.15)")
        if _ORIGINAL_FORWARD not in vars(layer):
            setattr(layer, _ORIGINAL_FORWARD, layer.forward)
            layer.forward = functools.partial(_forward, layer, active_row)
    if layers:
        logger.info("tree-packed forward enabled for %d Gated DeltaNet layers", len(layers))


def disable_tree_deltanet(model: torch.nn.Module) -> None:
    """Give every Gated DeltaNet layer its own forward back."""
    for layer in deltanet_layers(model):
        original = vars(layer).pop(_ORIGINAL_FORWARD, None)
        if original is not None:
            layer.forward = original


def _forward(
    layer: torch.nn.Module, active_row: Callable[[], object | None], *args, **kwargs
) -> torch.Tensor:
    mask = kwargs.pop(_MASK_KWARG, None)
    if mask is None:
        if active_row() is not None:  # the layer's own forward would mix samples and sibling branches
            raise RuntimeError(f"{type(layer).__name__} was called without the packed row although one "
                               "is being forwarded: this transformers version does not pass the "
                               "decoder layer's keyword arguments to its linear-attention layer; "
                               "upgrade to transformers >= 5.15")
        return getattr(layer, _ORIGINAL_FORWARD)(*args, **kwargs)
    hidden_states = args[0] if args else kwargs.pop("hidden_states")
    # a cache (transformers makes one unless use_cache=False) is left untouched: a tree has no single
    # state to continue from, and the trainer never decodes from a packed row
    if kwargs.get("attention_mask") is not None:
        raise ValueError("a tree-packed row has no padding: call the model without an attention_mask")
    return tree_deltanet_forward(layer, hidden_states, mask)


def tree_deltanet_forward(
    layer: torch.nn.Module, hidden_states: torch.Tensor, tree_mask: TreeMask
) -> torch.Tensor:
    """The layer's forward over one packed row. hidden_states [1, T, hidden] -> [1, T, hidden]."""
    batch, num_tokens, _ = hidden_states.shape
    if batch != 1 or num_tokens != tree_mask.num_tokens:
        raise ValueError(f"a Gated DeltaNet layer runs one packed row of {tree_mask.num_tokens} tokens, got "
                         f"hidden states of batch {batch} x {num_tokens} tokens; pass input_ids/position_ids "
                         "of shape [1, T]")
    layout = tree_mask.recurrent_layout(layer.conv_kernel_size)
    mixed_qkv, z, b, a = deltanet_projections(layer, hidden_states[0])
    mixed_qkv = tree_causal_conv1d(mixed_qkv, layer.conv1d.weight[:, 0], layer.conv1d.bias, layout,
                                   layer.activation)
    query, key, value, g, beta = delta_rule_inputs(layer, mixed_qkv, b, a)
    shape = DeltaRuleShape(layer.num_v_heads, layer.head_k_dim, layer.head_v_dim, hidden_states.dtype)
    backend = resolve_delta_rule_backend(tree_mask.deltanet_backend, hidden_states.device, shape)
    core = tree_gated_delta_rule(query, key, value, g, beta, layout, backend=backend)
    return deltanet_output(layer, core, z)[None]
