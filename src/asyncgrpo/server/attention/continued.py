"""Segment kind `continued`: prompt chunks that continue after tokens already in the paged KV cache.

A prefilled sequence whose first new token is not token 0 (its prefix came from the prefix cache,
or from its own earlier chunks under chunked prefill) cannot attend over its fresh keys alone: its
queries read the whole context back from the paged cache (the step wrote its own keys there before
any attention runs), query i of sequence b (position start_b + i) seeing keys 0 .. start_b + i.
The chunks the `rows` layout did not take (`rows.py`: short ones as decode rows) come here, in one of
two layouts of one computation:

    packed  `FlashContinued`: each chunk's context read from the cache into one packed run of keys and
            FlashAttention's variable-length kernel (CUDA, fp16/bf16, no soft-cap; `varlen.py`);
            `ReferencePackedContinued` computes the same on any device, only where the flags insist
    padded  `PaddedContinued` (`continued_layout`, any device, every variant): every chunk's context
            gathered into a [B, Smax] copy, queries padded to the longest chunk, a causal mask offset
            by each sequence's start, SDPA. Simple, but each layer copies every chunk's whole context,
            and the masked SDPA runs far below the GPU's attention rate

The layout is built once per step on the host; every layer reuses it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from asyncgrpo.server.attention.base import CONTINUED, AttentionBackend, Chunks, pad_indices, padded_tables
from asyncgrpo.server.attention.fresh import FlashFresh
from asyncgrpo.server.attention.varlen import ReferencePacked, VarlenChunks, cached_keys, varlen_chunks
from asyncgrpo.server.attention_math import attend, in_window
from asyncgrpo.server.host_copy import to_device


@dataclass
class ContinuedPrefill:
    """Step layout of the continued chunks (device tensors unless noted)."""

    lens: list[int]  # host: new tokens of each sequence, in order
    context_slots: torch.Tensor  # [B * Smax] int64: cache row of each context position, padded
    mask: torch.Tensor  # [B, 1, Lmax, Smax] bool: key j visible to query i
    pad_index: torch.Tensor  # [B * Lmax] int64 into this part's tokens (0 where padding)
    unpad_index: torch.Tensor  # [T] int64 into the padded [B * Lmax] layout
    query_pos: torch.Tensor  # [B, Lmax] int64 position of each (padded) query

    kind = CONTINUED

    @property
    def num_tokens(self) -> int:
        return sum(self.lens)


def continued_layout(
    block_size: int,
    scratch_slot: int,
    lens: Sequence[int],
    starts: Sequence[int],
    tables: Sequence[Sequence[int]] | np.ndarray,
    device: torch.device,
) -> ContinuedPrefill:
    """Layout of sequences computing tokens [start, start + len) over their blocks `tables` (lists, or
    the scheduler's [B, >= nb] rows); padded context rows point at `scratch_slot` (finite, never
    visible to a real query)."""
    starts, lens_arr = np.asarray(starts, dtype=np.int64), np.asarray(lens, dtype=np.int64)
    ctx = starts + lens_arr
    smax, lmax = int(ctx.max()), int(lens_arr.max())
    p = np.arange(smax)
    blocks = padded_tables(tables, ctx, block_size, 0)
    slots = blocks[:, p // block_size] * block_size + p % block_size
    slots[p[None, :] >= ctx[:, None]] = scratch_slot
    # padded queries (i >= len_b) see a few padded keys too, which keeps their rows finite (then dropped);
    # the mask is built on the device from the positions (a host-built one would be B x Lmax x Smax bytes)
    query_pos = to_device(starts[:, None] + np.arange(lmax)[None, :], device)
    mask = torch.arange(smax, device=device)[None, None, :] <= query_pos[:, :, None]
    pad, unpad = pad_indices(lens)
    return ContinuedPrefill(
        lens=list(lens),
        context_slots=to_device(slots.reshape(-1), device),
        mask=mask[:, None],
        pad_index=to_device(pad, device),
        unpad_index=to_device(unpad, device),
        query_pos=query_pos,
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


class PaddedContinued(AttentionBackend):
    """Continued chunks padded into a batch over their gathered contexts (any device, every variant)."""

    kind = CONTINUED
    name = "padded"
    reads = ContinuedPrefill

    def claims(self, chunks: Chunks) -> int:
        return len(chunks)  # every chunk no earlier layout took

    def build(self, chunks: Chunks, cache, device: torch.device) -> ContinuedPrefill:
        scratch_slot = cache.scratch_block * cache.block_size
        return continued_layout(cache.block_size, scratch_slot, chunks.lens.tolist(), chunks.starts,
                                chunks.tables, device)

    def forward(self, q, k, v, k_pool, v_pool, segment: ContinuedPrefill, scale, window,
                softcap) -> torch.Tensor:
        return continued_attention(q, k_pool, v_pool, segment, scale, window, softcap)


class FlashContinued(FlashFresh):
    """Continued chunks packed for FlashAttention, over their contexts read from the cache."""

    kind = CONTINUED

    def claims(self, chunks: Chunks) -> int:
        return len(chunks)

    def build(self, chunks: Chunks, cache, device: torch.device) -> VarlenChunks:
        return varlen_chunks(chunks.lens, chunks.starts, chunks.tables, cache.block_size, device)

    def forward(self, q, k, v, k_pool, v_pool, segment: VarlenChunks, scale, window, softcap) -> torch.Tensor:
        keys, values = cached_keys(k_pool, segment), cached_keys(v_pool, segment)
        return self.packed(q.transpose(0, 1), keys, values, segment, scale, window)


class ReferencePackedContinued(ReferencePacked, FlashContinued):
    """The packed layout of continued chunks through `varlen_reference`: only where insisted on."""
