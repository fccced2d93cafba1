"""Host-side index arithmetic the prompt layouts share: each chunk token's position, the indices
between packed tokens and a padded batch, and block tables cut to what each chunk reads (numpy, int64)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def chunk_positions(lens: np.ndarray, starts: np.ndarray) -> np.ndarray:
    """[sum(lens)] int64: the position of every token of chunks of `lens` tokens after `starts`, chunk
    after chunk."""
    lens, starts = np.asarray(lens, dtype=np.int64), np.asarray(starts, dtype=np.int64)
    return np.repeat(starts - (np.cumsum(lens) - lens), lens) + np.arange(int(lens.sum()))


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
