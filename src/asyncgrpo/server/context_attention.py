"""Attention of prompt chunks that continue after tokens already in the paged KV cache.

A prefilled sequence whose first new token is not token 0 (its prefix came from the prefix cache,
or from its own earlier chunks under chunked prefill) cannot attend over its fresh keys alone: its
queries read the whole context back from the paged cache (the step wrote its own keys there before
any attention runs), padded to the longest context of the step, with a causal mask offset by each
sequence's start:

    query i of sequence b (position start_b + i) sees keys 0 .. start_b + i

The layout (cache rows, mask, query padding) is built once per step on the host; every layer reuses it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from asyncgrpo.server.attention_math import attend, in_window


@dataclass
class ContinuedPrefill:
    """Step layout of the continued chunks (device tensors unless noted)."""

    lens: list[int]  # host: new tokens of each sequence, in order
    context_slots: torch.Tensor  # [B * Smax] int64: cache row of each context position, padded
    mask: torch.Tensor  # [B, 1, Lmax, Smax] bool: key j visible to query i
    pad_index: torch.Tensor  # [B * Lmax] int64 into this part's tokens (0 where padding)
    unpad_index: torch.Tensor  # [T] int64 into the padded [B * Lmax] layout
    query_pos: torch.Tensor  # [B, Lmax] int64 position of each (padded) query

    @property
    def num_tokens(self) -> int:
        return sum(self.lens)


def pad_indices(lens: Sequence[int]) -> tuple[list[int], list[int]]:
    """(pad, unpad) index lists between len(lens) packed sequences and a [B, max(lens)] layout."""
    lmax = max(lens)
    pad, unpad, start = [], [], 0
    for i, n in enumerate(lens):
        pad.extend(range(start, start + n))
        pad.extend([0] * (lmax - n))
        unpad.extend(range(i * lmax, i * lmax + n))
        start += n
    return pad, unpad


def continued_layout(
    block_size: int,
    scratch_slot: int,
    lens: Sequence[int],
    starts: Sequence[int],
    tables: Sequence[Sequence[int]],
    device: torch.device,
) -> ContinuedPrefill:
    """Layout of sequences computing tokens [start, start + len) over their blocks `tables`;
    padded context rows point at `scratch_slot` (finite, never visible to a real query)."""
    ctx = [s + n for s, n in zip(starts, lens)]
    smax, lmax = max(ctx), max(lens)
    slots = np.full((len(ctx), smax), scratch_slot, dtype=np.int64)
    for b, (n, table) in enumerate(zip(ctx, tables)):
        p = np.arange(n)
        slots[b, :n] = np.asarray(table, dtype=np.int64)[p // block_size] * block_size + p % block_size
    # padded queries (i >= len_b) see a few padded keys too, which keeps their rows finite (then dropped)
    query_pos = torch.as_tensor(starts, dtype=torch.int64)[:, None] + torch.arange(lmax)[None, :]
    mask = torch.arange(smax)[None, None, :] <= query_pos[:, :, None]
    pad, unpad = pad_indices(lens)
    return ContinuedPrefill(
        lens=list(lens),
        context_slots=torch.from_numpy(slots.reshape(-1)).to(device, non_blocking=True),
        mask=mask[:, None].to(device, non_blocking=True),
        pad_index=torch.tensor(pad, dtype=torch.int64).to(device, non_blocking=True),
        unpad_index=torch.tensor(unpad, dtype=torch.int64).to(device, non_blocking=True),
        query_pos=query_pos.to(device, non_blocking=True),
    )


def continued_attention(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    part: ContinuedPrefill,
    scaling: float,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """q [H, T, D] of the continued chunks; pools [num_blocks, block_size, kv_heads, D] of one layer
    (this step's keys already written); the layer's sliding window and soft-cap. Returns [T, H, D]."""
    h, _, d = q.shape
    kvh = k_pool.shape[2]
    b, lmax = len(part.lens), max(part.lens)
    smax = part.mask.shape[-1]

    def context(pool: torch.Tensor) -> torch.Tensor:
        rows = pool.view(-1, kvh, d).index_select(0, part.context_slots)
        return rows.view(b, smax, kvh, d).transpose(1, 2)

    mask = part.mask
    if window is not None:
        key_pos = torch.arange(smax, device=q.device)
        mask = mask & in_window(part.query_pos[:, None, :, None], key_pos, window)
    query = q.index_select(1, part.pad_index).view(h, b, lmax, d).transpose(0, 1)
    out = attend(query, context(k_pool), context(v_pool), mask, scaling, softcap)
    return out.transpose(1, 2).reshape(b * lmax, h, d).index_select(0, part.unpad_index)
