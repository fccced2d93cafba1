"""Segment layout `rows`: short chunks after cached tokens as rows of the paged decode attention.

Where the Triton decode attention and its shared-prefix pass run, every token of a short chunk that
continues after cached tokens is one query row of the decode attention: its sequence's block table,
context start_b + i + 1. Nothing is copied, and runs of consecutive rows of one sequence form groups of
the shared-prefix pass (`shared_prefix.py`): the cached blocks before a run's first row are read once
for all its rows. A chunk of r runs reads its context about r times, where the padded layout of
`continued.py` reads it about three times (gather, copy, attention) and then attends slowly, so chunks
of at most MAX_RUNS runs take this layout: a GRPO group's members, whose prompts are cached but for
their last block, compute that block this way; a long chunk (the rest of a prompt cut at the step's
token budget, a conversation's next turn) is left to `continued`.

`ContinuedRows` is a layout only: it builds a `DecodeSegment`, which the plan's `decode` /
`decode_shared` backends compute. A step that replays a CUDA graph (`step_graphs.py`) lays every
chunk out this way (`step_rows.prompt_rows`) when `fits_graph` says its chunks read little enough.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from asyncgrpo.server.attention.base import (
    ROWS,
    AttentionBackend,
    Chunks,
    DecodeSegment,
    Probe,
    Variant,
    chunk_positions,
    padded_tables,
)
from asyncgrpo.server.attention.decode import triton_works_on
from asyncgrpo.server.attention.shared_prefix import MIN_SHARED_BLOCKS, SharedPrefixes
from asyncgrpo.server.host_copy import to_device

# chunks of at most this many shared-prefix runs take the rows layout (see above)
MAX_RUNS = 4
# in a step that replays a graph (`step_graphs.py`) every chunk is rows, and a chunk of r runs reads
# its context about r times: a step whose chunks would read more cached tokens than this in all (about
# 30 GB of keys and values per step at 0.6B, less where the runs of a chunk meet in the L2 cache) runs
# eagerly instead, its long chunks padded
ROW_STEP_READS = 1 << 18


def row_step_reads(lens: np.ndarray, starts: np.ndarray, members: int) -> int:
    """Cached tokens the rows of chunks (`lens` new tokens after `starts`) read at most, in runs of
    `members` rows: each run up to its chunk's end."""
    return int((-(-lens // max(members, 1)) * (starts + lens)).sum())


def rows_sharing(
    lens: Sequence[int], starts: Sequence[int], tables: np.ndarray, block_size: int, members: int,
    null_block: int,
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
) -> DecodeSegment:
    """Rows layout of sequences computing tokens [start, start + len) over their blocks `tables`; runs of
    up to `members` rows of one sequence share its cached blocks (`rows_sharing`; < 2: none)."""
    ends = np.asarray(starts, dtype=np.int64) + np.asarray(lens, dtype=np.int64)
    padded = padded_tables(tables, ends, block_size, null_block)
    seq_of_row = to_device(np.repeat(np.arange(len(lens)), lens), device)
    context = chunk_positions(lens, starts) + 1
    shared = rows_sharing(lens, starts, padded, block_size, members, null_block)
    return DecodeSegment(
        num_tokens=int(sum(lens)),
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


class ContinuedRows(AttentionBackend):
    """The leading short continued chunks as decode rows, in runs of the shared pass's members."""

    kind = ROWS
    name = "rows"
    reads = DecodeSegment

    @classmethod
    def check(cls, probe: Probe, variant: Variant) -> bool:
        """Where the Triton kernel runs the variant (the gather would copy each row's whole context) and
        it has no window (a windowed layer reads each row's window on its own); or where insisted on."""
        flag = probe.flags.continued_rows
        if flag is not None:
            return flag
        windowed, capped = variant
        return probe.device.type == "cuda" and not windowed and triton_works_on(probe.device, probe.dtype,
                                                                                windowed, capped)

    @property
    def members(self) -> int:
        """Rows per run that read their cached blocks once (the shared pass's members per group entry)."""
        return self.probe.shared_members

    def claims(self, chunks: Chunks) -> int:
        fresh = np.flatnonzero(chunks.starts == 0)
        leading = len(chunks) if len(fresh) == 0 else int(fresh[0])  # (only chunks after cached tokens)
        return num_row_chunks(chunks.lens[:leading].tolist(), self.members)

    def build(self, chunks: Chunks, cache, device: torch.device) -> DecodeSegment:
        return continued_rows(cache.block_size, cache.scratch_block, chunks.lens.tolist(),
                              chunks.starts.tolist(), chunks.tables, device, self.members)

    def fits_graph(self, lens: np.ndarray, starts: np.ndarray) -> bool:
        """Whether chunks (`lens` new tokens after `starts`) read little enough to run as rows of a
        replayed graph (ROW_STEP_READS)."""
        return row_step_reads(lens, starts, self.members) <= ROW_STEP_READS
