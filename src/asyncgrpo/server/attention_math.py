"""Masked attention with the options some families add: a sliding window and logit soft-capping.

    attend   softmax(mask(cap(q k^T * scale))) v, where cap(s) = softcap * tanh(s / softcap)
             (Gemma 2); SDPA when there is no soft-cap, an explicit product otherwise
    sliding  the window rule of transformers: a query at position p sees keys at p - window < j <= p
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


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
    h, kvh = query.shape[1], key.shape[1]
    if not softcap:
        return F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scale, enable_gqa=h != kvh)
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
