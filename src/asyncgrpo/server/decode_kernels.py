"""The Triton kernels of decode attention over the paged KV cache, and their launch
(`decode_attention_triton`), which the Triton backends of `attention/decode.py` and
`attention/shared_prefix.py` run where the execution plan took them.

One program per (sequence, kv head, context split) walks the block table and reads only the sequence's
own cached rows once, with an online softmax in float32; small batches split the context so that every
multiprocessor has work, and a second kernel merges the splits. Given groups of sequences that share
their first blocks (`attention/shared_prefix.py`), a third kernel reads those blocks once per group for
all its members' queries. A sliding window (the loop starts at the first key it reaches) and a logit soft-cap
are compile-time switches: a variant left unused costs nothing.
"""

from __future__ import annotations

import functools

import torch

from asyncgrpo.server.attention.base import SharedPrefixTensors


@functools.cache
def _triton_kernels():
    """(attention kernel, merge kernel, shared-prefix kernel), compiled on first use, or None when Triton
    is not importable."""
    # module globals: Triton's interpreter (the CPU tests) patches the kernels' `tl` there, and finds the
    # kernels' shared device function there (it rebuilds each kernel from its source, without closures)
    global triton, tl, attend_span
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None

    @triton.jit
    def attend_span(q, k_ptr, v_ptr, table_ptr, kv_offset, begin, end, stride_kb, stride_kt, scale, softcap,
                    ROWS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr,
                    IEEE: tl.constexpr, SOFTCAP: tl.constexpr):
        """Online softmax of the query rows q [ROWS, HEAD_DIM] over the cached keys [begin, end) of one
        block table row (`table_ptr`) and one kv head (`kv_offset`): (running max, sum of exp, unnormalised
        output [ROWS, HEAD_DIM]), in float32; (-inf, 0, 0) for an empty span."""
        d = tl.arange(0, HEAD_DIM)
        t = tl.arange(0, TILE)
        m = tl.full([ROWS], float("-inf"), tl.float32)
        l = tl.zeros([ROWS], tl.float32)
        acc = tl.zeros([ROWS, HEAD_DIM], tl.float32)
        for start in range(begin, end, TILE):
            pos = start + t
            valid = pos < end
            block = tl.load(table_ptr + pos // BLOCK_SIZE, mask=valid, other=0)
            rows = block * stride_kb + (pos % BLOCK_SIZE) * stride_kt + kv_offset
            k = tl.load(k_ptr + rows[:, None] + d[None, :], mask=valid[:, None], other=0.0)
            v = tl.load(v_ptr + rows[:, None] + d[None, :], mask=valid[:, None], other=0.0)
            if IEEE:
                s = tl.dot(q, tl.trans(k), input_precision="ieee")
            else:
                s = tl.dot(q, tl.trans(k))
            s = s * scale
            if SOFTCAP:  # softcap * tanh(s / softcap), with tanh from exp(-2|x|) in (0, 1]: never overflows
                e = tl.exp(-2.0 * tl.abs(s) / softcap)  # (libdevice's tanh does not run in the interpreter)
                s = tl.where(s < 0, -softcap, softcap) * (1.0 - e) / (1.0 + e)
            s = tl.where(valid[None, :], s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, axis=1))
            p = tl.exp(s - m_new[:, None])
            alpha = tl.exp(m - m_new)
            l = l * alpha + tl.sum(p, axis=1)
            if IEEE:
                acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m = m_new
        return m, l, acc

    # what varies from step to step (split counts and lengths, the block tables' width) is a run-time
    # argument Triton does not specialise on: one compiled kernel serves every step (a compile in the
    # middle of serving stalls a step for ~1 s); the plan's warm-up (`ExecutionPlan.warm_up`) launches
    # each variant at start
    @triton.jit(do_not_specialize=["stride_tb", "split_len", "num_splits", "shared_slots"])
    def paged_decode_kernel(
        q_ptr, k_ptr, v_ptr, tables_ptr, lens_ptr, shared_ptr, out_ptr, part_ptr, stats_ptr,
        stride_qb, stride_qh,
        stride_kb, stride_kt, stride_kh,
        stride_tb,
        stride_ob, stride_oh,
        scale,
        split_len,
        window,
        softcap,
        num_splits,
        shared_slots,
        NUM_HEADS: tl.constexpr,
        SPLIT: tl.constexpr,
        SHARED: tl.constexpr,
        GROUP: tl.constexpr,
        GROUP_PAD: tl.constexpr,
        WINDOWED: tl.constexpr,
        SOFTCAP: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        BLOCK_SIZE: tl.constexpr,
        TILE: tl.constexpr,
        IEEE: tl.constexpr,
    ):
        # SPLIT: partial results, a sequence's `num_splits` own splits then `shared_slots` of the shared
        # pass (SHARED), for the merge kernel; else the output itself (one split, no shared pass)
        num_slots = num_splits + shared_slots
        seq = tl.program_id(0)
        kv_head = tl.program_id(1)
        split = tl.program_id(2)
        context = tl.load(lens_ptr + seq)
        shared = 0
        if SHARED:  # tokens before `shared` are the shared pass's (shared_prefix.py)
            shared = tl.load(shared_ptr + seq)
        first = shared  # the first key this pass reads; the splits divide [first, context)
        if WINDOWED:  # keys p - window < j <= p for the query at p = context - 1: blocks before are not read
            first = context - tl.minimum(context - shared, window)  # max(shared, context - window)
        begin = first + split * split_len
        end = tl.minimum(context, begin + split_len)
        g = tl.arange(0, GROUP_PAD)
        d = tl.arange(0, HEAD_DIM)
        heads = kv_head * GROUP + g
        # the GROUP query heads of this kv head, padded to the dot's minimum of 16 rows
        q = tl.load(q_ptr + seq * stride_qb + heads[:, None] * stride_qh + d[None, :],
                    mask=(g < GROUP)[:, None], other=0.0)
        m, l, acc = attend_span(q, k_ptr, v_ptr, tables_ptr + seq * stride_tb, kv_head * stride_kh, begin,
                                end, stride_kb, stride_kt, scale, softcap, GROUP_PAD, HEAD_DIM, BLOCK_SIZE,
                                TILE, IEEE, SOFTCAP)
        head_ok = (g < GROUP)[:, None]
        if not SPLIT:
            tl.store(out_ptr + seq * stride_ob + heads[:, None] * stride_oh + d[None, :],
                     (acc / l[:, None]).to(out_ptr.dtype.element_ty), mask=head_ok)
        else:  # this split's unnormalised sum and its (max, sum of exp); an empty split leaves (-inf, 0)
            part = (seq * NUM_HEADS + heads) * num_slots + split
            tl.store(part_ptr + part[:, None] * HEAD_DIM + d[None, :], acc, mask=head_ok)
            tl.store(stats_ptr + part * 2, m, mask=g < GROUP)
            tl.store(stats_ptr + part * 2 + 1, l, mask=g < GROUP)
            if SHARED:  # noqa: SIM102 -- a compile-time switch around a run-time test
                if (split == 0) & (shared == 0):  # in no group: its shared slots stay empty
                    for slot in range(num_splits, num_slots):
                        empty = (seq * NUM_HEADS + heads) * num_slots + slot
                        tl.store(part_ptr + empty[:, None] * HEAD_DIM + d[None, :],
                                 tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32), mask=head_ok)
                        tl.store(stats_ptr + empty * 2, tl.full([GROUP_PAD], float("-inf"), tl.float32),
                                 mask=g < GROUP)
                        tl.store(stats_ptr + empty * 2 + 1, tl.zeros([GROUP_PAD], tl.float32), mask=g < GROUP)

    @triton.jit(do_not_specialize=["stride_tb", "num_splits", "shared_slots"])
    def shared_prefix_kernel(
        q_ptr, k_ptr, v_ptr, tables_ptr, groups_ptr, part_ptr, stats_ptr,
        stride_qb, stride_qh,
        stride_kb, stride_kt, stride_kh,
        stride_tb,
        stride_g,
        scale,
        softcap,
        num_splits,
        shared_slots,
        NUM_HEADS: tl.constexpr,
        GROUP: tl.constexpr,
        MEMBERS: tl.constexpr,
        ROWS_PAD: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        BLOCK_SIZE: tl.constexpr,
        TILE: tl.constexpr,
        IEEE: tl.constexpr,
        SOFTCAP: tl.constexpr,
    ):
        # one program per (group entry, kv head, split of the shared tokens): the queries of every
        # member's GROUP heads of this kv head are the rows of one tile, so each K/V row is read once;
        # the entry's own length sets the splits (graph replays see other lengths than the capture)
        num_slots = num_splits + shared_slots
        entry = tl.program_id(0)
        kv_head = tl.program_id(1)
        split = tl.program_id(2)
        row = groups_ptr + entry * stride_g
        length = tl.load(row)  # shared tokens (0 in a padding entry, whose members are all -1)
        r = tl.arange(0, ROWS_PAD)
        d = tl.arange(0, HEAD_DIM)
        member = r // GROUP
        seq = tl.load(row + 1 + member, mask=member < MEMBERS, other=-1)
        ok = seq >= 0
        heads = kv_head * GROUP + r % GROUP
        leader = tl.load(row + 1)
        q = tl.load(q_ptr + seq[:, None] * stride_qb + heads[:, None] * stride_qh + d[None, :],
                    mask=ok[:, None], other=0.0)
        split_len = tl.cdiv(tl.cdiv(length, shared_slots), TILE) * TILE
        begin = split * split_len
        end = tl.minimum(length, begin + split_len)
        m, l, acc = attend_span(q, k_ptr, v_ptr, tables_ptr + leader * stride_tb, kv_head * stride_kh, begin,
                                end, stride_kb, stride_kt, scale, softcap, ROWS_PAD, HEAD_DIM, BLOCK_SIZE,
                                TILE, IEEE, SOFTCAP)
        part = (seq * NUM_HEADS + heads) * num_slots + num_splits + split
        tl.store(part_ptr + part[:, None] * HEAD_DIM + d[None, :], acc, mask=ok[:, None])
        tl.store(stats_ptr + part * 2, m, mask=ok)
        tl.store(stats_ptr + part * 2 + 1, l, mask=ok)

    @triton.jit(do_not_specialize=["num_slots"])
    def merge_splits_kernel(
        part_ptr, stats_ptr, out_ptr,
        stride_ob, stride_oh,
        num_slots,
        NUM_HEADS: tl.constexpr,
        SLOTS_TILE: tl.constexpr,
        HEAD_DIM: tl.constexpr,
    ):
        # the flash-decoding merge of a (sequence, head)'s partial results, SLOTS_TILE slots at a time
        # (any number of slots, one compiled kernel):
        # out = sum_i w_i acc_i / sum_i w_i l_i, w_i = e^(m_i - max m)
        seq = tl.program_id(0)
        head = tl.program_id(1)
        sp = tl.arange(0, SLOTS_TILE)
        d = tl.arange(0, HEAD_DIM)
        base = (seq * NUM_HEADS + head) * num_slots
        m_run = tl.full([1], float("-inf"), tl.float32)
        l_run = tl.zeros([1], tl.float32)
        acc_run = tl.zeros([HEAD_DIM], tl.float32)
        for first in range(0, num_slots, SLOTS_TILE):
            ok = first + sp < num_slots
            part = base + first + sp
            m = tl.load(stats_ptr + part * 2, mask=ok, other=float("-inf"))
            l = tl.load(stats_ptr + part * 2 + 1, mask=ok, other=0.0)
            acc = tl.load(part_ptr + part[:, None] * HEAD_DIM + d[None, :], mask=ok[:, None], other=0.0)
            # finite from the first tile on: own split 0 is never empty
            m_new = tl.maximum(m_run, tl.max(m, axis=0))
            weight = tl.exp(m - m_new)
            alpha = tl.exp(m_run - m_new)
            l_run = l_run * alpha + tl.sum(l * weight, axis=0)
            acc_run = acc_run * alpha + tl.sum(acc * weight[:, None], axis=0)
            m_run = m_new
        tl.store(out_ptr + seq * stride_ob + head * stride_oh + d,
                 (acc_run / l_run).to(out_ptr.dtype.element_ty))

    return paged_decode_kernel, merge_splits_kernel, shared_prefix_kernel


def triton_available() -> bool:
    return _triton_kernels() is not None


@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":  # CPU tensors: Triton's interpreter (tests), one program at a time
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count


def one_split_programs(num_sms: int) -> int:
    """Programs (sequences x kv heads) from which `choose_splits` never splits a context."""
    return 2 * num_sms


def choose_splits(num_programs: int, max_context: int, tile: int, num_sms: int) -> tuple[int, int]:
    """(number of splits, tokens per split) of each sequence's context: enough programs to give every
    multiprocessor about two, each split a whole number of tiles (host-side: fixed for a graph)."""
    tiles = -(-max_context // tile)
    splits = max(1, min(tiles, -(-one_split_programs(num_sms) // num_programs)))
    split_len = -(-tiles // splits) * tile
    return -(-max_context // split_len), split_len


def decode_attention_triton(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    tile: int = 64,
    num_splits: int | None = None,
    num_warps: int = 4,
    num_stages: int = 2,
    shared: SharedPrefixTensors | None = None,
    num_shared_splits: int | None = None,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Same contract as `decode_attention_gather`; every context length must be >= 1.

    Small batches split each context across several programs (flash-decoding) whose partial
    results a second kernel merges; `num_splits` overrides the choice (tests). `tile` (tokens per
    iteration), `num_warps` and `num_stages` are the launch configuration (bench/attention_configs.py
    times the alternatives). `shared`: groups of sequences whose first blocks are the same
    (`shared_prefix.py`); a third kernel reads those blocks once per group, in `num_shared_splits`
    splits (default: chosen like `num_splits`), and the merge adds its partial results. With a
    `window`, each sequence reads only the blocks its window reaches (the splits divide the window,
    not the table); a window excludes `shared` (members of a group see different windows)."""
    kernels = _triton_kernels()
    if kernels is None:
        raise RuntimeError("decode_attention_triton needs Triton (it ships with PyTorch's CUDA wheels)")
    attend, merge, attend_shared = kernels
    bd, h, d = q.shape
    _, block_size, kvh, _ = k_pool.shape
    assert k_pool.stride() == v_pool.stride() and k_pool.stride(-1) == 1, "K and V pools share one layout"
    assert d >= 16 and d & (d - 1) == 0, f"head_dim must be a power of two >= 16, got {d}"
    group = h // kvh
    tile = max(tile, 16)
    assert window is None or (window >= 1 and shared is None), (
        "a window of >= 1 token, without the shared pass")
    max_context = block_tables.shape[1] * block_size
    span = max_context if window is None else min(window, max_context)  # keys one sequence reads at most
    if num_splits is None:
        num_splits, split_len = choose_splits(bd * kvh, span, tile, _num_sms(q.device))
    else:
        per_split = -(-span // num_splits)
        split_len = -(-per_split // tile) * tile
    shared_slots = 0
    if shared is not None:
        num_entries, width = shared.groups.shape
        if num_shared_splits is None:
            shared_slots, _ = choose_splits(num_entries * kvh, max_context, tile, _num_sms(q.device))
        else:
            shared_slots = num_shared_splits
    num_slots = num_splits + shared_slots
    q = q.contiguous() if q.stride(-1) != 1 else q
    out = torch.empty(bd, h, d, dtype=q.dtype, device=q.device)
    part = stats = out  # unused when the context is not split
    if num_slots > 1:
        part = torch.empty(bd, h, num_slots, d, dtype=torch.float32, device=q.device)
        stats = torch.empty(bd, h, num_slots, 2, dtype=torch.float32, device=q.device)
    common = {"HEAD_DIM": d, "BLOCK_SIZE": block_size, "TILE": tile, "IEEE": q.dtype == torch.float32,
              "SOFTCAP": bool(softcap), "num_warps": num_warps, "num_stages": num_stages}
    softcap = float(softcap or 1.0)  # unused without SOFTCAP
    if shared_slots:
        members = width - 1
        attend_shared[(num_entries, kvh, shared_slots)](
            q, k_pool, v_pool, block_tables, shared.groups, part, stats,
            q.stride(0), q.stride(1),
            k_pool.stride(0), k_pool.stride(1), k_pool.stride(2),
            block_tables.stride(0),
            shared.groups.stride(0),
            scale,
            softcap,
            num_splits,
            shared_slots,
            NUM_HEADS=h, GROUP=group, MEMBERS=members,
            ROWS_PAD=max(16, 1 << (members * group - 1).bit_length()), **common,
        )
    attend[(bd, kvh, num_splits)](
        q, k_pool, v_pool, block_tables, context_lens, context_lens if shared is None else shared.lens,
        out, part, stats,
        q.stride(0), q.stride(1),
        k_pool.stride(0), k_pool.stride(1), k_pool.stride(2),
        block_tables.stride(0),
        out.stride(0), out.stride(1),
        scale,
        split_len,
        window or 0,
        softcap,
        num_splits,
        shared_slots,
        NUM_HEADS=h,
        SPLIT=num_slots > 1,
        SHARED=shared_slots > 0,
        GROUP=group,
        GROUP_PAD=max(16, 1 << (group - 1).bit_length()),
        WINDOWED=window is not None,
        **common,
    )
    if num_slots > 1:
        merge[(bd, h)](part, stats, out, out.stride(0), out.stride(1), num_slots, NUM_HEADS=h, SLOTS_TILE=16,
                       HEAD_DIM=d)
    return out
