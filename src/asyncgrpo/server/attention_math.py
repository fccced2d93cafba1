"""Masked attention with the options some families add: a sliding window and logit soft-capping.

    attend   softmax(mask(cap(q k^T * scale))) v, where cap(s) = softcap * tanh(s / softcap)
             (Gemma 2); SDPA when there is no soft-cap, an explicit product otherwise
    sliding  the window rule of transformers: a query at position p sees keys at p - window < j <= p
    windows  each attention module's window, and the one that bounds what any layer reads (`kv_window`);
             the (window, soft-cap) combinations a model's layers use (`attention_variants`)
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)


def attend(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    softcap: float | None = None,
) -> torch.Tensor:
    """query [B, H, L, D], key/value [B, KVH, S, D] (H a multiple of KVH), mask bool broadcastable to
    [B, H, L, S] (True = visible; every row needs one). Returns [B, H, L, D]."""
    b, h, length, d = query.shape
    kvh = key.shape[1]
    if not softcap:
        while mask.dim() < 4:
            mask = mask[None]
        if h == kvh or mask.shape[1] != 1:
            return F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scale,
                                                  enable_gqa=h != kvh)
        # one mask for all heads: the query heads of a kv head become more queries of that head (SDPA's
        # kernels for an explicit mask take no grouped heads; it would fall back to its plain math)
        group = h // kvh
        if mask.shape[2] != 1:
            mask = (mask[:, :, None].expand(-1, -1, group, -1, -1)
                    .reshape(mask.shape[0], 1, group * length, -1))
        out = F.scaled_dot_product_attention(query.reshape(b, kvh, group * length, d), key, value,
                                             attn_mask=mask, scale=scale)
        return out.reshape(b, h, length, d)
    if h != kvh:
        key = key.repeat_interleave(h // kvh, dim=1)
        value = value.repeat_interleave(h // kvh, dim=1)
    scores = torch.matmul(query.float(), key.float().transpose(-1, -2)) * scale
    scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1), value.float()).to(query.dtype)


def in_window(query_pos: torch.Tensor, key_pos: torch.Tensor, window: int | None) -> torch.Tensor | bool:
    """Whether each key is inside each query's sliding window (broadcast query_pos [..., L, 1] against
    key_pos [..., S]); True everywhere without a window."""
    if window is None:
        return True
    return key_pos > query_pos - window


def module_window(module: torch.nn.Module) -> int | None:
    """The window an attention module's own forward passes: its attribute (Qwen2, Gemma: None on full
    layers), else the config's (Mistral reads config.sliding_window in its forward)."""
    if hasattr(module, "sliding_window"):
        return module.sliding_window
    return getattr(module.config, "sliding_window", None)


def attention_variants(model: torch.nn.Module) -> set[tuple[bool, bool]]:
    """(has a sliding window, has a logit soft-cap) of each of the model's attention modules (those with
    a `layer_idx` and an `o_proj`): the decode attention variants its layers run."""
    return {(module_window(m) is not None, bool(getattr(m, "attn_logit_softcapping", None)))
            for m in model.modules()
            if isinstance(getattr(m, "layer_idx", None), int) and hasattr(m, "o_proj")}


def kv_window(model: torch.nn.Module, attention_layers: Sequence[int]) -> int | None:
    """The window past which no layer with keys/values reads (the largest of the layers' windows), or
    None when one of those layers attends over the whole context (Gemma 2/3 and Cohere2 interleave
    such layers), or when the model's attention modules (those with a `layer_idx` and an `o_proj`) do
    not map one to one onto `attention_layers`. Tokens further back than it can leave the KV cache."""
    windows = {m.layer_idx: module_window(m) for m in model.modules()
               if isinstance(getattr(m, "layer_idx", None), int) and hasattr(m, "o_proj")}
    if not windows or set(windows) != set(attention_layers):
        return None
    if None in windows.values():
        if any(w is not None for w in windows.values()):
            logger.info("some attention layers see the whole context: KV blocks are held for the whole "
                        "sequence even where the sliding-window layers no longer read them")
        return None
    window = max(windows.values())
    logger.info("every attention layer has a sliding window of at most %d tokens: KV blocks behind it "
                "are freed", window)
    return window
