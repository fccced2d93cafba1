"""Attention of prompt chunks that continue after tokens already in the paged KV cache.

A prefilled sequence whose first new token is not token 0 (its prefix came from the prefix cache,
or from its own earlier chunks under chunked prefill) cannot attend over its fresh keys alone: its
queries read the whole context back from the paged cache (the step wrote its own keys there before
any attention runs), query i of sequence b (position start_b + i) seeing keys 0 .. start_b + i.
Two layouts of one computation:

    padded (`continued_layout`, any device)
        every chunk's context gathered into a [B, Smax] copy, queries padded to the longest chunk,
        a causal mask offset by each sequence's start, SDPA. Simple, but each layer copies every
        chunk's whole context, and the masked SDPA runs far below the GPU's attention rate. Where
        FlashAttention's variable-length kernel runs, the runner packs these chunks for it instead
        (`varlen_attention.py`).
    rows (`continued_rows`, short chunks, where the Triton decode attention and its shared-prefix
    pass run)
        every chunk token is a query row of the paged decode attention (`decode_attention.py`): its
        sequence's block table, context start_b + i + 1. Nothing is copied, and runs of consecutive
        rows of one sequence form groups of the shared-prefix pass (`shared_prefix.py`): the cached
        blocks before a run's first row are read once for all its rows. A chunk of r runs reads its
        context about r times, where the padded layout reads it about three times (gather, copy,
        attention) and then attends slowly, so chunks of at most MAX_RUNS runs take this layout: a
        GRPO group's members, whose prompts are cached but for their last block, compute that block
        this way; a long chunk (the rest of a prompt cut at the step's token budget, a conversation's
        next turn) stays padded.

The layout is built once per step on the host; every layer reuses it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from asyncgrpo.server.attention_math import attend, in_window
from asyncgrpo.server.decode_attention import decode_attention
from asyncgrpo.server.host_copy import to_device
from asyncgrpo.server.shared_prefix import MIN_SHARED_BLOCKS, SharedPrefixes, SharedPrefixTensors

# chunks of at most this many shared-prefix runs take the rows layout (see above)
MAX_RUNS = 4
# in a step that replays a graph (`step_graphs.py`) every chunk is rows, and a chunk of r runs reads
# its context about r times: a step whose chunks would read more cached tokens than this in all (about
# 30 GB of keys and values per step at 0.6B, less where the runs of a chunk meet in the L2 cache) runs
# eagerly instead, its long chunks padded
ROW_STEP_READS = 1 << 18


def chunk_positions(lens: np.ndarray, starts: np.ndarray) -> np.ndarray:
    """[sum(lens)] int64: the position of every token of chunks of `lens` tokens after `starts`, chunk
    after chunk."""
    lens, starts = np.asarray(lens, dtype=np.int64), np.asarray(starts, dtype=np.int64)
    return np.repeat(starts - (np.cumsum(lens) - lens), lens) + np.arange(int(lens.sum()))


def row_step_reads(lens: np.ndarray, starts: np.ndarray, members: int) -> int:
    """Cached tokens the rows of chunks (`lens` new tokens after `starts`) read at most, in runs of
    `members` rows: each run up to its chunk's end."""
    return int((-(-lens // max(members, 1)) * (starts + lens)).sum())


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


def pad_indices(lens: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    """(pad, unpad) int64 indices between len(lens) packed sequences and a [B, max(lens)] layout: pad
    [B * max(lens)] into the packed tokens (0 where padding), unpad [sum(lens)] into the layout."""
    lens = np.asarray(lens, dtype=np.int64)
    lmax = int(lens.max())
    j = np.arange(lmax)
    real = j[None, :] < lens[:, None]
    first = np.cumsum(lens) - lens
    pad = np.where(real, first[:, None] + j[None, :], 0).reshape(-1)
    unpad = (np.arange(len(lens))[:, None] * lmax + j[None, :])[real]
    return pad, unpad


def padded_tables(tables: Sequence[Sequence[int]] | np.ndarray, ends: np.ndarray, block_size: int,
                  fill: int) -> np.ndarray:
    """[B, nb] int64: the blocks of each sequence that hold its tokens [0, end), `fill` past them
    (nb covers the longest). tables: a block list per sequence, or a [B, >= nb] array (the scheduler's)."""
    used = -(-ends // block_size)
    width = int(used.max())
    if isinstance(tables, np.ndarray):
        out = tables[:, :width].copy()
    else:
        out = np.full((len(used), width), fill, dtype=np.int64)
        for b, (n, table) in enumerate(zip(used.tolist(), tables)):
            out[b, :n] = table[:n]
    out[np.arange(width)[None, :] >= used[:, None]] = fill
    return out


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


@dataclass
class ContinuedRows:
    """The continued chunks as rows of the paged decode attention (device tensors unless noted)."""

    lens: list[int]  # host: new tokens of each sequence, in order
    block_tables: torch.Tensor  # [T, nb] int64: each row's sequence's blocks (null-padded)
    context_lens: torch.Tensor  # [T] int64: keys each row sees (its position + 1)
    shared: SharedPrefixTensors | None  # runs of rows of one sequence that read its cached blocks once

    @property
    def num_tokens(self) -> int:
        return sum(self.lens)


def rows_sharing(
    lens: Sequence[int], starts: Sequence[int], tables: np.ndarray, block_size: int, members: int, null_block: int
) -> SharedPrefixes | None:
    """The shared-prefix groups of the rows layout: each sequence's rows in runs of at most `members`;
    a run of two or more shares the blocks wholly before its first row (not past a released block, and
    from MIN_SHARED_BLOCKS on). tables: [B, nb] per sequence. (`shared_prefix.find_shared_prefixes` would
    find such groups too, but by sorting every row's table each step; here the rows of a sequence are
    already together, with one table.)"""
    if members < 2:
        return None
    released = tables == null_block
    first_null = np.where(released.any(axis=1), released.argmax(axis=1), tables.shape[1])
    row_lens = np.zeros(sum(lens), dtype=np.int64)
    entries, row = [], 0
    for b, (n, start) in enumerate(zip(lens, starts)):
        for first in range(0, n, members):
            run = min(members, n - first)
            shared = min((start + first) // block_size, int(first_null[b]))
            if run >= 2 and shared >= MIN_SHARED_BLOCKS:
                rows = list(range(row + first, row + first + run))
                row_lens[rows] = shared * block_size
                entries.append([shared * block_size, *rows, *([-1] * (members - run))])
        row += n
    if not entries:
        return None
    return SharedPrefixes(lens=row_lens, groups=np.asarray(entries, dtype=np.int64))


def continued_rows(
    block_size: int,
    null_block: int,
    lens: Sequence[int],
    starts: Sequence[int],
    tables: Sequence[Sequence[int]],
    device: torch.device,
    members: int,
) -> ContinuedRows:
    """Rows layout of sequences computing tokens [start, start + len) over their blocks `tables`; runs of
    up to `members` rows of one sequence share its cached blocks (`rows_sharing`; < 2: none)."""
    ends = np.asarray(starts, dtype=np.int64) + np.asarray(lens, dtype=np.int64)
    padded = padded_tables(tables, ends, block_size, null_block)
    seq_of_row = to_device(np.repeat(np.arange(len(lens)), lens), device)
    context = chunk_positions(lens, starts) + 1
    shared = rows_sharing(lens, starts, padded, block_size, members, null_block)
    return ContinuedRows(
        lens=list(lens),
        # a row per token, expanded on the device (at long contexts the rows' tables are large)
        block_tables=to_device(padded, device).index_select(0, seq_of_row),
        context_lens=to_device(context, device),
        shared=None if shared is None else shared.to(device),
    )


def num_row_chunks(lens: Sequence[int], members: int) -> int:
    """How many of the leading chunks (lengths `lens`, the scheduler puts the shortest first) take the
    rows layout with runs of `members` rows: those of at most MAX_RUNS runs (none without the shared pass)."""
    if members < 2:
        return 0
    limit, n = MAX_RUNS * members, 0
    while n < len(lens) and lens[n] <= limit:
        n += 1
    return n


def rows_attention(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    rows: ContinuedRows,
    scaling: float,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """q [H, T, D] of the chunks in the rows layout -> [T, H, D]."""
    return decode_attention(q.transpose(0, 1), k_pool, v_pool, rows.block_tables, rows.context_lens, scaling,
                            window, softcap, rows.shared)
