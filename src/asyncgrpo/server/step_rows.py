"""A step's rows of the paged decode attention, built on the host (int64 arrays).

A decode sequence is one row: its last token over its cached context (`decode_inputs`). A step whose
prompt chunks are short enough to replay a CUDA graph (`step_graphs.py`) makes every chunk token one
more row, which sees its sequence's tokens up to itself (`prompt_rows`); runs of a chunk's rows read
the blocks before them once (`attention.rows.rows_sharing`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from asyncgrpo.server.attention.base import chunk_positions
from asyncgrpo.server.attention.rows import rows_sharing
from asyncgrpo.server.attention.shared_prefix import SharedPrefixes
from asyncgrpo.server.sequence import Sequence


@dataclass
class StepRows:
    """Host inputs of a step's rows of the paged decode attention, one entry per row (int64 arrays):
    a decode sequence's new token (`decode_inputs`), or a prompt chunk's token (`prompt_rows`)."""

    token_ids: np.ndarray  # [B] each row's token (a decode sequence's last one)
    positions: np.ndarray  # [B] its position
    slots: np.ndarray  # [B] flat cache row its keys/values go to
    context_lens: np.ndarray  # [B] cached tokens it sees, itself included
    block_tables: np.ndarray  # [B, nb] its sequence's blocks; nb covers the longest
    seq_rows: np.ndarray  # [B] its sequence's scheduler row (the slot of its DeltaNet state, its LoRA slot)
    shared: SharedPrefixes | None = None  # groups whose first blocks are the same (read once each)
    sample_rows: np.ndarray | None = None  # rows whose logits are sampled, in order (None: every row)
    # each row's LoRA slot (-1: the base model; None: no adapters served)
    lora_slots: np.ndarray | None = None

    @property
    def kv_tokens(self) -> int:
        """Context tokens the attention reads for these rows, each group's shared part once."""
        total = int(self.context_lens.sum())
        if self.shared is not None:
            total -= int(self.shared.lens.sum()) - int(self.shared.groups[:, 0].sum())
        return total


def decode_inputs(
    last_tokens: np.ndarray, num_tokens: np.ndarray, rows: np.ndarray, block_table: np.ndarray,
    block_size: int,
) -> StepRows:
    """Inputs of decode sequences from their last token, length (incl. that token) and block-table row."""
    positions = num_tokens - 1
    num_blocks = -(-int(num_tokens.max()) // block_size)
    tables = block_table[rows, :num_blocks]
    blocks = tables[np.arange(len(rows)), positions // block_size]
    return StepRows(last_tokens, positions, blocks * block_size + positions % block_size, num_tokens, tables,
                    rows)


def prompt_rows(
    dec: StepRows | None, prefill: list[Sequence], block_table: np.ndarray, block_size: int, members: int,
    null_block: int,
) -> StepRows:
    """A step as rows of the decode attention (`step_graphs.py`): the decode rows `dec` (None: none),
    then a row per token of each prompt chunk, which sees its sequence's tokens up to itself. Runs of up
    to `members` rows of a chunk read its blocks before them once (`attention.rows.rows_sharing`);
    the rows that sample are the decode rows and the last row of each chunk that ends its prompt."""
    nd = 0 if dec is None else len(dec.token_ids)
    lens = np.fromiter((s.prefill_end - s.prefill_start for s in prefill), np.int64, len(prefill))
    starts = np.fromiter((s.prefill_start for s in prefill), np.int64, len(prefill))
    num_blocks = -(-int((starts + lens).max()) // block_size)
    if dec is not None:
        num_blocks = max(num_blocks, dec.block_tables.shape[1])
    chunk_rows = np.fromiter((s.row for s in prefill), np.int64, len(prefill))
    seq_tables = block_table[chunk_rows, :num_blocks]
    positions = chunk_positions(lens, starts)
    tables = np.repeat(seq_tables, lens, axis=0)
    seq_rows = np.repeat(chunk_rows, lens)
    slots = tables[np.arange(len(positions)), positions // block_size] * block_size + positions % block_size
    ids = np.concatenate([np.asarray(s.all_tokens()[s.prefill_start : s.prefill_end], np.int64)
                          for s in prefill])
    ends = np.fromiter((s.prefill_end == s.num_tokens for s in prefill), bool, len(prefill))
    sample_rows = np.concatenate([np.arange(nd), nd + np.cumsum(lens)[ends] - 1])
    shared = rows_sharing(lens.tolist(), starts.tolist(), seq_tables, block_size, members, null_block)
    if dec is None:
        return StepRows(ids, positions, slots, positions + 1, tables, seq_rows, shared, sample_rows)
    dec_tables = np.full((nd, num_blocks), null_block, dtype=np.int64)  # entries past a context are not read
    dec_tables[:, : dec.block_tables.shape[1]] = dec.block_tables
    return StepRows(
        np.concatenate([dec.token_ids, ids]),
        np.concatenate([dec.positions, positions]),
        np.concatenate([dec.slots, slots]),
        np.concatenate([dec.context_lens, positions + 1]),
        np.concatenate([dec_tables, tables]),
        np.concatenate([dec.seq_rows, seq_rows]),
        SharedPrefixes.concat(dec.shared, nd, shared, len(ids)),
        sample_rows,
    )
