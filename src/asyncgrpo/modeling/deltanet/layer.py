"""A Gated DeltaNet layer's own steps around the delta rule, as its transformers forward runs them.

    hidden [T, hidden] --deltanet_projections--> mixed q|k|v [T, conv_dim], z, b, a
    mixed --causal_conv1d_at--> convolved q|k|v   (a depthwise causal convolution of width W, SiLU)
    convolved, b, a --delta_rule_inputs--> query, key, value, g, beta   (the delta rule's inputs)
    (delta rule: `delta_rule.py`) core [T, H, V] --deltanet_output--> [T, hidden]

The functions use the layer's own modules (projections, `A_log`, `dt_bias`, gated norm, output
projection), so a caller that feeds the convolution and the delta rule what the layer would see
reproduces the layer's forward. Which tokens the convolution window and the recurrent state carry
over is the caller's: a tree-packed row's trie path (`packing/`), or a sequence's stored window and
state in the server (`server/recurrent_state.py`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["DELTANET_CLASSES", "causal_conv1d_at", "delta_rule_inputs", "deltanet_layers", "deltanet_output",
           "deltanet_projections"]

DELTANET_CLASSES = frozenset({"Qwen3_5GatedDeltaNet", "Qwen3_5MoeGatedDeltaNet", "Qwen3NextGatedDeltaNet"})
"""Layer classes whose tree-packed forward (training) and server-step forward were checked against the
layer's own (transformers >= 5.15)."""


def deltanet_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The Gated DeltaNet layers of `model` (any wrapper of a transformers model)."""
    return [m for m in model.modules() if type(m).__name__ in DELTANET_CLASSES]


def deltanet_projections(layer: torch.nn.Module, hidden_states: torch.Tensor):
    """The layer's input projections of hidden_states [T, hidden], either layout: (mixed q|k|v
    [T, conv_dim], the convolution's input; z [T, H, V]; b [T, H]; a [T, H])."""
    x = hidden_states[None]
    if hasattr(layer, "in_proj_qkvz"):  # Qwen3-Next: q/k/v/z and b/a interleaved per key head group
        query, key, value, z, b, a = layer.fix_query_key_value_ordering(layer.in_proj_qkvz(x),
                                                                         layer.in_proj_ba(x))
        mixed = torch.cat([t.reshape(t.shape[0], t.shape[1], -1) for t in (query, key, value)], dim=-1)
        return mixed[0], z[0], b[0], a[0]
    z = layer.in_proj_z(x)[0]
    return layer.in_proj_qkv(x)[0], z.reshape(z.shape[0], -1, layer.head_v_dim), layer.in_proj_b(x)[0], \
        layer.in_proj_a(x)[0]


def causal_conv1d_at(padded: torch.Tensor, keep: torch.Tensor, weight: torch.Tensor,
                     bias: torch.Tensor | None, activation: str | None = "silu") -> torch.Tensor:
    """Depthwise causal convolution over `padded` [N, C], a concatenation in which each output
    position in `keep` [T] is preceded by the W - 1 inputs its window reads; returns those T
    outputs [T, C] in padded's dtype (computed in weight's dtype, like transformers)."""
    channels, width = weight.shape
    out = F.conv1d(padded.T[None].to(weight.dtype), weight[:, None, :], bias, padding=width - 1,
                   groups=channels)
    out = out[0, :, : padded.shape[0]].T.index_select(0, keep)
    if activation in ("silu", "swish"):
        out = F.silu(out)
    elif activation is not None:
        raise ValueError(f"unsupported convolution activation {activation!r} "
                         "(Gated DeltaNet layers use 'silu')")
    return out.to(padded.dtype)


def delta_rule_inputs(layer: torch.nn.Module, mixed_qkv: torch.Tensor, b: torch.Tensor, a: torch.Tensor):
    """(query [T, Hk, K], key [T, Hk, K], value [T, H, V], g [T, H], beta [T, H]) from the
    convolution's output [T, conv_dim] and the b/a projections, as the layer's own forward makes them."""
    num_tokens = mixed_qkv.shape[0]
    query, key, value = torch.split(mixed_qkv, [layer.key_dim, layer.key_dim, layer.value_dim], dim=-1)
    query = query.reshape(num_tokens, -1, layer.head_k_dim)
    key = key.reshape(num_tokens, -1, layer.head_k_dim)
    value = value.reshape(num_tokens, -1, layer.head_v_dim)
    # float32 as in the layer's own forward (an fp16 A_log.exp() may overflow)
    g = -layer.A_log.float().exp() * F.softplus(a.float() + layer.dt_bias)
    return query, key, value, g, b.sigmoid()


def deltanet_output(layer: torch.nn.Module, core: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """The gated norm and output projection of the delta rule's output core [T, H, V] -> [T, hidden]."""
    num_tokens = core.shape[0]
    core = layer.norm(core.reshape(-1, layer.head_v_dim), z.reshape(-1, layer.head_v_dim))
    return layer.out_proj(core.reshape(num_tokens, -1))
