"""Attention of prompt chunks after cached tokens (`server/attention/continued.py`, `rows.py`), every
layout, against a plain per-sequence computation in float64: the padded layout, the rows layout (each
chunk token a query of the paged decode attention; on the CPU through the gather backends, which compute
what the Triton kernels compute), with and without runs that read a sequence's cached blocks once, with
a sliding window and a soft-cap; the packed layout of FlashAttention's variable-length kernel
(`server/attention/varlen.py`, on the CPU through its reference computation), for chunks after cached
tokens and prompts from token 0; the runs themselves (where a released block stops them); and
`attend`'s folding of grouped query heads. Segments run through the backends a CPU execution plan
takes for them, as the server's attention function runs them."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from asyncgrpo.server.attention.base import (
    CONTINUED,
    FRESH,
    PlanFlags,
    Probe,
    chunk_positions,
    pad_indices,
    variant_of,
)
from asyncgrpo.server.attention.continued import continued_attention, continued_layout
from asyncgrpo.server.attention.plan import ALL_VARIANTS, probe_plan
from asyncgrpo.server.attention.rows import MAX_RUNS, continued_rows, num_row_chunks, rows_sharing
from asyncgrpo.server.attention.shared_prefix import MIN_SHARED_BLOCKS, max_members
from asyncgrpo.server.attention.varlen import varlen_check_error, varlen_chunks, varlen_works_on
from asyncgrpo.server.attention_math import attend

BS = 4
TOL = {"atol": 1e-5, "rtol": 1e-5}  # the soft-cap and the shared runs compute in float32, as the kernels do
HEADS, KV_HEADS, DIM = 4, 2, 8
CPU = torch.device("cpu")
# what the server takes on the CPU with the rows layout asked for (decode rows through the gather backends),
# for layers of every variant; and with packed prompt chunks (their reference computation), which no
# soft-capped layer takes
ROWS_PLAN = probe_plan(Probe(CPU, torch.float64, HEADS, KV_HEADS, DIM, ALL_VARIANTS,
                             PlanFlags(shared_prefix=True, continued_rows=True),
                             max_members(HEADS, KV_HEADS)))
PACKED_PLAN = probe_plan(Probe(CPU, torch.float64, HEADS, KV_HEADS, DIM,
                               frozenset({(False, False), (True, False)}), PlanFlags(packed_prompts=True)))


def rows_attention(q, k_pool, v_pool, rows, scale, window=None, softcap=None):
    """q [H, T, D] of chunks laid out as decode rows -> [T, H, D], through the plan's decode backends."""
    backend = ROWS_PLAN.backend(rows.kind, variant_of(window, softcap))
    return backend.forward(q, None, None, k_pool, v_pool, rows, scale, window, softcap)


def continued_varlen_attention(q, k_pool, v_pool, packed, scale, window=None):
    """q [H, T, D] of chunks after cached tokens, packed -> [T, H, D]."""
    assert packed.kind == CONTINUED
    backend = PACKED_PLAN.backend(CONTINUED, variant_of(window, None))
    return backend.forward(q, None, None, k_pool, v_pool, packed, scale, window, None)


def fresh_attention(q, k, v, packed, scale, window=None):
    """q [H, T, D], k/v [KVH, T, D] of prompts from token 0, packed -> [T, H, D]."""
    assert packed.kind == FRESH
    return PACKED_PLAN.backend(FRESH, variant_of(window, None)).forward(q, k, v, None,
                                                                        None, packed, scale, window,
                                                                       None)


def _case(seed: int, starts: list[int], lens: list[int]):
    """Pools with a scratch (null) block last, each sequence on its own shuffled blocks."""
    g = torch.Generator().manual_seed(seed)
    widths = [-(-(s + n) // BS) for s, n in zip(starts, lens)]
    num_blocks = sum(widths) + 3
    k_pool, v_pool = (torch.randn(num_blocks + 1, BS, KV_HEADS, DIM, generator=g, dtype=torch.float64)
                      for _ in range(2))
    order = torch.randperm(num_blocks, generator=g).tolist()
    tables, at = [], 0
    for w in widths:
        tables.append(order[at: at + w] + [order[-1]])  # one entry past the chunk, as a prompt's later blocks
        at += w
    q = torch.randn(HEADS, sum(lens), DIM, generator=g, dtype=torch.float64) * 3
    return q, k_pool, v_pool, tables, num_blocks


def _reference(q, k_pool, v_pool, tables, starts, lens, window=None, softcap=None):
    """Each sequence alone: its context read block by block, query i at start + i sees keys <= it (and
    inside the window)."""
    outs, at = [], 0
    group = HEADS // KV_HEADS
    for table, start, n in zip(tables, starts, lens):
        ctx = start + n
        pos = torch.arange(ctx)
        rows = torch.tensor(table)[pos // BS] * BS + pos % BS
        k = k_pool.view(-1, KV_HEADS, DIM)[rows].repeat_interleave(group, 1)  # [S, H, D]
        v = v_pool.view(-1, KV_HEADS, DIM)[rows].repeat_interleave(group, 1)
        qs = q[:, at: at + n]  # [H, n, D]
        scores = torch.einsum("hid,shd->his", qs, k) * DIM**-0.5
        if softcap:
            scores = torch.tanh(scores / softcap) * softcap
        qpos = start + torch.arange(n)
        visible = pos[None, :] <= qpos[:, None]
        if window is not None:
            visible &= pos[None, :] > qpos[:, None] - window
        scores = scores.masked_fill(~visible, float("-inf"))
        outs.append(torch.einsum("his,shd->ihd", scores.softmax(-1), v))
        at += n
    return torch.cat(outs)


# group members' last blocks after a cached prompt, a chunk from mid-block, a long chunk, one token
STARTS, LENS = [24, 24, 24, 10, 32, 7], [3, 3, 4, 9, 22, 1]


@pytest.mark.parametrize("members", [0, 2, 4, 8])
def test_rows_layout_matches_the_padded_one_and_a_plain_computation(members):
    q, k_pool, v_pool, tables, null = _case(0, STARTS, LENS)
    ref = _reference(q, k_pool, v_pool, tables, STARTS, LENS)
    padded = continued_layout(BS, null * BS, LENS, STARTS, tables, q.device)
    torch.testing.assert_close(continued_attention(q, k_pool, v_pool, padded, DIM**-0.5), ref)
    rows = continued_rows(BS, null, LENS, STARTS, tables, q.device, members)
    assert (rows.shared is not None) == (members >= 2)
    torch.testing.assert_close(rows_attention(q, k_pool, v_pool, rows, DIM**-0.5), ref, **TOL)


@pytest.mark.parametrize("window,softcap", [(5, None), (None, 2.0), (6, 3.0)])
def test_rows_layout_with_a_window_or_softcap(window, softcap):
    q, k_pool, v_pool, tables, null = _case(1, STARTS, LENS)
    ref = _reference(q, k_pool, v_pool, tables, STARTS, LENS, window, softcap)
    rows = continued_rows(BS, null, LENS, STARTS, tables, q.device, 4)
    torch.testing.assert_close(rows_attention(q, k_pool, v_pool, rows, DIM**-0.5, window, softcap), ref,
                               **TOL)
    padded = continued_layout(BS, null * BS, LENS, STARTS, tables, q.device)
    torch.testing.assert_close(continued_attention(q, k_pool, v_pool, padded, DIM**-0.5, window, softcap),
                               ref, **TOL)


@pytest.mark.parametrize("window", [None, 5])
def test_packed_layout_matches_a_plain_computation(window):
    q, k_pool, v_pool, tables, _ = _case(2, STARTS, LENS)
    ref = _reference(q, k_pool, v_pool, tables, STARTS, LENS, window)
    packed = varlen_chunks(LENS, STARTS, tables, BS, q.device)
    assert packed.key_lens == [s + n for s, n in zip(STARTS, LENS)]
    assert packed.cu_q.tolist() == [0, *np.cumsum(LENS)] and packed.cu_q.dtype == torch.int32
    assert packed.cu_k.tolist() == [0, *np.cumsum(packed.key_lens)]
    torch.testing.assert_close(continued_varlen_attention(q, k_pool, v_pool, packed, DIM**-0.5, window), ref)
    # the scheduler's block-table rows (wider than the chunks, padded past them) give the same keys
    rows = np.full((len(tables), 20), 999, dtype=np.int64)
    for b, t in enumerate(tables):
        rows[b, : len(t)] = t
    assert torch.equal(varlen_chunks(LENS, STARTS, rows, BS, q.device).key_slots, packed.key_slots)


@pytest.mark.parametrize("window", [None, 3])
def test_packed_prompts_from_token_zero_attend_over_their_own_keys(window):
    lens = [7, 1, 12]
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(h, sum(lens), DIM, generator=g, dtype=torch.float64)
               for h in (HEADS, KV_HEADS, KV_HEADS))
    packed = varlen_chunks(lens, [0] * len(lens), None, BS, q.device)
    assert packed.key_slots is None and packed.key_lens == lens
    got = fresh_attention(q, k, v, packed, DIM**-0.5, window)
    outs, at = [], 0  # each prompt alone
    for n in lens:
        rows = torch.arange(at, at + n)
        kk = k.transpose(0, 1)[rows].repeat_interleave(HEADS // KV_HEADS, 1)
        vv = v.transpose(0, 1)[rows].repeat_interleave(HEADS // KV_HEADS, 1)
        scores = torch.einsum("hid,shd->his", q[:, at: at + n], kk) * DIM**-0.5
        pos = torch.arange(n)
        visible = (pos[None, :] <= pos[:, None]) & (
            (pos[None, :] > pos[:, None] - window) if window else True)
        outs.append(torch.einsum("his,shd->ihd", scores.masked_fill(~visible, float("-inf")).softmax(-1), vv))
        at += n
    torch.testing.assert_close(got, torch.cat(outs))


def test_the_flash_kernel_is_only_taken_on_cuda_in_half_precision():
    assert not varlen_works_on(torch.device("cpu"), torch.bfloat16, HEADS, KV_HEADS, DIM)
    assert not varlen_works_on(torch.device("cpu"), torch.float32, HEADS, KV_HEADS, DIM, True)
    # the check's layouts (strided views of a joined projection, gathered keys) on the reference path
    for windowed in (False, True):
        assert varlen_check_error(torch.device("cpu"), torch.float32, HEADS, KV_HEADS, DIM, windowed) == 0.0


def test_the_flash_check_catches_misaligned_chunks_and_a_missing_window(monkeypatch):
    """A kernel that aligned each chunk's queries to the start of its keys (SDPA's causal rule) or ignored
    the layer's window would be refused: the check measures it far from the reference."""
    import asyncgrpo.server.attention.varlen as module

    cpu = torch.device("cpu")
    reference = module.varlen_reference
    monkeypatch.setattr(module, "varlen", lambda q, k, v, part, scale, window=None: torch.cat([
        reference(q[a:b], k[c:d], v[c:d], [b - a], [b - a], scale, window)  # keys from the chunk's start
        for a, b, c, d in zip(part.cu_q[:-1].tolist(), part.cu_q[1:].tolist(), part.cu_k[:-1].tolist(),
                              part.cu_k[1:].tolist())]))
    assert varlen_check_error(cpu, torch.float32, HEADS, KV_HEADS, DIM) > 0.1
    monkeypatch.setattr(module, "varlen", lambda q, k, v, part, scale, window=None: reference(
        q, k, v, part.lens, part.key_lens, scale, None))  # no window
    assert varlen_check_error(cpu, torch.float32, HEADS, KV_HEADS, DIM, windowed=True) > 0.1


def test_rows_sharing_runs_of_one_sequence():
    starts, lens = [24, 10, 2, 24], [5, 3, 6, 1]
    tables = np.arange(4 * 8).reshape(4, 8)
    found = rows_sharing(lens, starts, tables, BS, members=2, null_block=99)
    # sequence 0 (rows 0-4): runs [0, 1] from position 24 (6 blocks), [2, 3] from 26 (still 6), row 4 alone;
    # sequence 1 (rows 5-7): 10 // 4 = 2 blocks < MIN_SHARED_BLOCKS; sequence 2: none; sequence 3: one row
    assert MIN_SHARED_BLOCKS == 4
    assert found.groups.tolist() == [[24, 0, 1], [24, 2, 3]]
    assert found.lens.tolist() == [24, 24, 24, 24, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0]
    # a released block (the null block) caps what a run shares
    tables[0, 5] = 99
    assert rows_sharing(lens, starts, tables, BS, 4, 99).groups.tolist() == [[20, 0, 1, 2, 3]]
    tables[0, 3] = 99
    assert rows_sharing(lens, starts, tables, BS, 4, 99) is None
    assert rows_sharing(lens, starts, tables, BS, 1, 99) is None


def test_short_chunks_take_the_rows_layout():
    members = 4
    limit = MAX_RUNS * members
    assert num_row_chunks([1, 3, limit, limit + 1, 2], members) == 3  # the leading short ones only
    assert num_row_chunks([limit + 1], members) == 0
    assert num_row_chunks([1, 2], 0) == 0  # without the shared pass every row would read its whole context


@pytest.mark.parametrize("mask_shape", ["per_batch", "shared", "one_query_row"])
def test_attend_folds_grouped_heads_under_an_explicit_mask(mask_shape):
    g = torch.Generator().manual_seed(3)
    b, length, s = 3, 5, 7
    q = torch.randn(b, HEADS, length, DIM, generator=g, dtype=torch.float64)
    k, v = (torch.randn(b, KV_HEADS, s, DIM, generator=g, dtype=torch.float64) for _ in range(2))
    full = {"per_batch": (b, 1, length, s), "shared": (length, s), "one_query_row": (b, 1, 1, s)}[mask_shape]
    mask = torch.rand(full, generator=g) < 0.6
    mask[..., 0] = True  # every row sees a key
    scores = torch.einsum("bhld,bhsd->bhls", q, k.repeat_interleave(2, 1)) * 0.3
    expected = torch.einsum("bhls,bhsd->bhld", scores.masked_fill(~mask, float("-inf")).softmax(-1),
                            v.repeat_interleave(2, 1))
    torch.testing.assert_close(attend(q, k, v, mask, 0.3), expected)


def test_both_layouts_take_the_schedulers_block_table_rows_as_well_as_block_lists():
    """The model runner passes its [B, max_blocks] block-table rows (entries past a sequence's blocks
    hold anything); the layouts equal those built from each sequence's own block list."""
    q, k_pool, v_pool, tables, null = _case(3, STARTS, LENS)
    rows = np.full((len(tables), 20), 5, dtype=np.int64)  # 5: a stale block past every sequence's own
    for b, t in enumerate(tables):
        rows[b, : len(t) - 1] = t[:-1]
    ref = continued_attention(q, k_pool, v_pool,
                              continued_layout(BS, null * BS, LENS, STARTS, tables, q.device), DIM**-0.5)
    got = continued_attention(q, k_pool, v_pool,
                              continued_layout(BS, null * BS, LENS, STARTS, rows, q.device), DIM**-0.5)
    torch.testing.assert_close(got, ref, **TOL)
    from_lists = continued_rows(BS, null, LENS, STARTS, tables, q.device, 2)
    from_rows = continued_rows(BS, null, LENS, STARTS, rows, q.device, 2)
    assert torch.equal(from_rows.block_tables, from_lists.block_tables)
    assert torch.equal(from_rows.shared.groups, from_lists.shared.groups)


def test_pad_indices_move_packed_tokens_to_a_padded_layout_and_back():
    lens = [3, 1, 4]
    pad, unpad = pad_indices(lens)
    assert pad.tolist() == [0, 1, 2, 0, 3, 0, 0, 0, 4, 5, 6, 7]
    assert unpad.tolist() == [0, 1, 2, 4, 8, 9, 10, 11]
    packed = np.arange(100, 108)
    assert (packed[pad][unpad] == packed).all()  # to the padded layout and back


def test_chunk_positions_lay_each_chunks_positions_end_to_end():
    assert chunk_positions([3, 1, 2], [0, 7, 32]).tolist() == [0, 1, 2, 7, 32, 33]
    assert chunk_positions([], []).tolist() == []
