"""Decode attention over the paged KV cache: one new query token per sequence.

Two implementations of one function:

- `decode_attention_gather` (any device): gathers each sequence's blocks into a dense
  [B, L, kv_heads, D] copy and runs SDPA with a length mask. Simple, but every step copies the
  padded cache of every layer (L is the longest context rounded up to a block bucket), which on a
  GPU costs more memory traffic than the attention itself.
- `decode_attention_triton` (CUDA with Triton): one program per (sequence, kv head, context split)
  walks the block table and reads only the sequence's own cached rows once, with an online softmax
  in float32; small batches split the context so that every multiprocessor has work, and a second
  kernel merges the splits. Given groups of sequences that share their first blocks (a GRPO
  group's cached prompt, `shared_prefix.py`), a third kernel reads those blocks once per group for
  all its members' queries, the per-sequence programs start after them, and the merge adds both.

Both take a layer's sliding window (the Triton kernel starts at the first key the window reaches, so
it reads only those blocks) and logit soft-cap (Gemma 2); the kernel compiles one variant per
combination, and a variant left unused costs nothing.

`decode_attention` picks the Triton kernel for CUDA tensors with a power-of-two head size when that
variant compiles and agrees with the gather on that device (checked once per device, e.g. older GPUs
lack its bfloat16 dot), else the gather.
"""

from __future__ import annotations

import functools
import logging

import torch

from asyncgrpo.server.attention_math import attend, in_window
from asyncgrpo.server.shared_prefix import SharedPrefixTensors, decode_attention_shared_gather

logger = logging.getLogger(__name__)


def decode_attention_gather(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """q [B, H, D]; pools [num_blocks, block_size, kv_heads, D]; block_tables [B, nb] int64 (entries
    past a sequence's blocks may hold any valid block); context_lens [B] int64; window: the layer's
    sliding window (keys p - window < j <= p for the query at p), softcap: its logit soft-cap.
    Returns [B, H, D]."""
    bd, h, d = q.shape
    _, block_size, kvh, _ = k_pool.shape
    group = h // kvh
    length = block_tables.shape[1] * block_size
    flat_tables = block_tables.reshape(-1)  # index_select: one gather of whole blocks (cheaper than [tables])
    keys = k_pool.index_select(0, flat_tables).view(bd, length, kvh, d).transpose(1, 2)
    values = v_pool.index_select(0, flat_tables).view(bd, length, kvh, d).transpose(1, 2)
    # the query heads sharing a kv head act as `group` queries of that head: no repeat needed
    query = q.reshape(bd, kvh, group, d)
    pos = torch.arange(length, device=q.device)[None, :]
    valid = (pos < context_lens[:, None]) & in_window(context_lens[:, None] - 1, pos, window)
    out = attend(query, keys, values, valid[:, None, None, :], scale, softcap)
    return out.reshape(bd, h, d)


@functools.cache
def _triton_kernels():
    """(attention kernel, merge kernel, shared-prefix kernel), compiled on first use, or None when Triton
    is not importable."""
    global triton, tl  # module globals: Triton's interpreter (the CPU tests) patches the kernels' `tl` there
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None

    @triton.jit
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
        NUM_HEADS: tl.constexpr,
        NUM_SPLITS: tl.constexpr,
        SHARED_SLOTS: tl.constexpr,
        GROUP: tl.constexpr,
        GROUP_PAD: tl.constexpr,
        WINDOWED: tl.constexpr,
        SOFTCAP: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        BLOCK_SIZE: tl.constexpr,
        TILE: tl.constexpr,
        IEEE: tl.constexpr,
    ):
        # a sequence's partial results: its NUM_SPLITS own splits, then SHARED_SLOTS of the shared pass
        NUM_SLOTS: tl.constexpr = NUM_SPLITS + SHARED_SLOTS
        seq = tl.program_id(0)
        kv_head = tl.program_id(1)
        split = tl.program_id(2)
        context = tl.load(lens_ptr + seq)
        shared = 0
        if SHARED_SLOTS > 0:  # tokens before `shared` are the shared pass's (shared_prefix.py)
            shared = tl.load(shared_ptr + seq)
        first = shared  # the first key this pass reads; the splits divide [first, context)
        if WINDOWED:  # keys p - window < j <= p for the query at p = context - 1: blocks before are not read
            first = context - tl.minimum(context - shared, window)  # max(shared, context - window)
        begin = first + split * split_len
        end = tl.minimum(context, begin + split_len)
        g = tl.arange(0, GROUP_PAD)
        d = tl.arange(0, HEAD_DIM)
        t = tl.arange(0, TILE)
        heads = kv_head * GROUP + g
        # the GROUP query heads of this kv head, padded to the dot's minimum of 16 rows
        q = tl.load(q_ptr + seq * stride_qb + heads[:, None] * stride_qh + d[None, :],
                    mask=(g < GROUP)[:, None], other=0.0)
        m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
        l = tl.zeros([GROUP_PAD], tl.float32)
        acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
        for start in range(begin, end, TILE):
            pos = start + t
            valid = pos < end
            block = tl.load(tables_ptr + seq * stride_tb + pos // BLOCK_SIZE, mask=valid, other=0)
            rows = block * stride_kb + (pos % BLOCK_SIZE) * stride_kt + kv_head * stride_kh
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
        head_ok = (g < GROUP)[:, None]
        if NUM_SLOTS == 1:
            tl.store(out_ptr + seq * stride_ob + heads[:, None] * stride_oh + d[None, :],
                     (acc / l[:, None]).to(out_ptr.dtype.element_ty), mask=head_ok)
        else:  # this split's unnormalised sum and its (max, sum of exp); an empty split leaves (-inf, 0)
            part = (seq * NUM_HEADS + heads) * NUM_SLOTS + split
            tl.store(part_ptr + part[:, None] * HEAD_DIM + d[None, :], acc, mask=head_ok)
            tl.store(stats_ptr + part * 2, m, mask=g < GROUP)
            tl.store(stats_ptr + part * 2 + 1, l, mask=g < GROUP)
            if SHARED_SLOTS > 0:  # noqa: SIM102 -- a compile-time switch around a run-time test
                if (split == 0) & (shared == 0):  # in no group: its shared slots stay empty
                    for slot in tl.static_range(NUM_SPLITS, NUM_SLOTS):
                        empty = (seq * NUM_HEADS + heads) * NUM_SLOTS + slot
                        tl.store(part_ptr + empty[:, None] * HEAD_DIM + d[None, :],
                                 tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32), mask=head_ok)
                        tl.store(stats_ptr + empty * 2, tl.full([GROUP_PAD], float("-inf"), tl.float32),
                                 mask=g < GROUP)
                        tl.store(stats_ptr + empty * 2 + 1, tl.zeros([GROUP_PAD], tl.float32), mask=g < GROUP)

    @triton.jit
    def shared_prefix_kernel(
        q_ptr, k_ptr, v_ptr, tables_ptr, groups_ptr, part_ptr, stats_ptr,
        stride_qb, stride_qh,
        stride_kb, stride_kt, stride_kh,
        stride_tb,
        stride_g,
        scale,
        softcap,
        NUM_HEADS: tl.constexpr,
        NUM_SPLITS: tl.constexpr,
        SHARED_SLOTS: tl.constexpr,
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
        NUM_SLOTS: tl.constexpr = NUM_SPLITS + SHARED_SLOTS
        entry = tl.program_id(0)
        kv_head = tl.program_id(1)
        split = tl.program_id(2)
        row = groups_ptr + entry * stride_g
        length = tl.load(row)  # shared tokens (0 in a padding entry, whose members are all -1)
        r = tl.arange(0, ROWS_PAD)
        d = tl.arange(0, HEAD_DIM)
        t = tl.arange(0, TILE)
        member = r // GROUP
        seq = tl.load(row + 1 + member, mask=member < MEMBERS, other=-1)
        ok = seq >= 0
        heads = kv_head * GROUP + r % GROUP
        leader = tl.load(row + 1)
        q = tl.load(q_ptr + seq[:, None] * stride_qb + heads[:, None] * stride_qh + d[None, :],
                    mask=ok[:, None], other=0.0)
        split_len = tl.cdiv(tl.cdiv(length, SHARED_SLOTS), TILE) * TILE
        begin = split * split_len
        end = tl.minimum(length, begin + split_len)
        m = tl.full([ROWS_PAD], float("-inf"), tl.float32)
        l = tl.zeros([ROWS_PAD], tl.float32)
        acc = tl.zeros([ROWS_PAD, HEAD_DIM], tl.float32)
        for start in range(begin, end, TILE):
            pos = start + t
            valid = pos < end
            block = tl.load(tables_ptr + leader * stride_tb + pos // BLOCK_SIZE, mask=valid, other=0)
            rows = block * stride_kb + (pos % BLOCK_SIZE) * stride_kt + kv_head * stride_kh
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
        part = (seq * NUM_HEADS + heads) * NUM_SLOTS + NUM_SPLITS + split
        tl.store(part_ptr + part[:, None] * HEAD_DIM + d[None, :], acc, mask=ok[:, None])
        tl.store(stats_ptr + part * 2, m, mask=ok)
        tl.store(stats_ptr + part * 2 + 1, l, mask=ok)

    @triton.jit
    def merge_splits_kernel(
        part_ptr, stats_ptr, out_ptr,
        stride_ob, stride_oh,
        NUM_HEADS: tl.constexpr,
        NUM_SPLITS: tl.constexpr,
        SPLITS_PAD: tl.constexpr,
        HEAD_DIM: tl.constexpr,
    ):
        seq = tl.program_id(0)
        head = tl.program_id(1)
        sp = tl.arange(0, SPLITS_PAD)
        d = tl.arange(0, HEAD_DIM)
        part = (seq * NUM_HEADS + head) * NUM_SPLITS + sp
        ok = sp < NUM_SPLITS
        m = tl.load(stats_ptr + part * 2, mask=ok, other=float("-inf"))
        l = tl.load(stats_ptr + part * 2 + 1, mask=ok, other=0.0)
        weight = tl.exp(m - tl.max(m, axis=0))  # own split 0 is never empty, so the max is finite
        acc = tl.load(part_ptr + part[:, None] * HEAD_DIM + d[None, :], mask=ok[:, None], other=0.0)
        out = tl.sum(acc * weight[:, None], axis=0) / tl.sum(l * weight, axis=0)
        tl.store(out_ptr + seq * stride_ob + head * stride_oh + d, out.to(out_ptr.dtype.element_ty))

    return paged_decode_kernel, merge_splits_kernel, shared_prefix_kernel


def triton_available() -> bool:
    return _triton_kernels() is not None


@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":  # CPU tensors: Triton's interpreter (tests), one program at a time
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count


def choose_splits(num_programs: int, max_context: int, tile: int, num_sms: int) -> tuple[int, int]:
    """(number of splits, tokens per split) of each sequence's context: enough programs to give every
    multiprocessor about two, each split a whole number of tiles (host-side: fixed for a graph)."""
    tiles = -(-max_context // tile)
    splits = max(1, min(tiles, -(-2 * num_sms // num_programs)))
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
    assert window is None or (window >= 1 and shared is None), "a window of >= 1 token, without the shared pass"
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
            NUM_HEADS=h, NUM_SPLITS=num_splits, SHARED_SLOTS=shared_slots, GROUP=group, MEMBERS=members,
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
        NUM_HEADS=h,
        NUM_SPLITS=num_splits,
        SHARED_SLOTS=shared_slots,
        GROUP=group,
        GROUP_PAD=max(16, 1 << (group - 1).bit_length()),
        WINDOWED=window is not None,
        **common,
    )
    if num_slots > 1:
        merge[(bd, h)](
            part, stats, out, out.stride(0), out.stride(1),
            NUM_HEADS=h, NUM_SPLITS=num_slots, SPLITS_PAD=max(2, 1 << (num_slots - 1).bit_length()), HEAD_DIM=d,
        )
    return out


def decode_attention(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
    shared: SharedPrefixTensors | None = None,
) -> torch.Tensor:
    """Decode attention with the best implementation for the device (see the module docstring), per
    variant (sliding window or not, soft-cap or not) of the Triton kernel that passed its check.
    `shared` (groups sharing their first blocks) changes how layers without a window read those blocks:
    once per group (Triton), or through the group's first table (`decode_attention_shared_gather`, plain
    layers elsewhere). Windowed layers read each sequence's own blocks: the window bounds what they read,
    and the members of a group, at different lengths, see different windows."""
    d = q.shape[-1]
    windowed, capped = window is not None, bool(softcap)
    if q.is_cuda and d >= 16 and d & (d - 1) == 0 and triton_works_on(q.device, q.dtype, windowed, capped):
        if windowed or (shared is not None and not shared_pass_works_on(q.device, q.dtype, capped)):
            shared = None
        return decode_attention_triton(q, k_pool, v_pool, block_tables, context_lens, scale, shared=shared,
                                       window=window, softcap=softcap)
    if not windowed and not capped and shared is not None:
        return decode_attention_shared_gather(q, k_pool, v_pool, block_tables, context_lens, scale, shared)
    return decode_attention_gather(q, k_pool, v_pool, block_tables, context_lens, scale, window, softcap)


@functools.cache
def triton_works_on(device: torch.device, dtype: torch.dtype, windowed: bool = False, capped: bool = False) -> bool:
    """Whether the Triton kernel's variant (with a sliding window, with a soft-cap) compiles on this
    device and matches the gather path on random input (once per device, dtype and variant; call it
    outside CUDA-graph capture: the server checks its model's variants at load time)."""
    return _triton_matches_gather(device, dtype, shared_pass=False, windowed=windowed, capped=capped)


@functools.cache
def shared_pass_works_on(device: torch.device, dtype: torch.dtype, capped: bool = False) -> bool:
    """The same check for the shared-prefix pass (`shared_prefix.py`, layers without a window); where it
    fails, decode attention keeps the plain Triton kernel and reads every sequence's blocks itself."""
    return triton_works_on(device, dtype, False, capped) and _triton_matches_gather(
        device, dtype, shared_pass=True, windowed=False, capped=capped)


def check_decode_variants(device: torch.device, dtype: torch.dtype, variants: set[tuple[bool, bool]]) -> None:
    """Run the checks of the (windowed, capped) variants a model's layers use, and of the shared pass of
    those without a window, now (at load time, before any CUDA graph is captured)."""
    shared_pass_works_on(device, dtype)  # the runner decides on the shared pass from the plain variant
    for windowed, capped in sorted(variants):
        if windowed:
            triton_works_on(device, dtype, windowed, capped)
        else:
            shared_pass_works_on(device, dtype, capped)


def _triton_matches_gather(device: torch.device, dtype: torch.dtype, shared_pass: bool, windowed: bool,
                           capped: bool) -> bool:
    if _triton_kernels() is None:
        return False
    g = torch.Generator(device=device).manual_seed(0)
    pools = [torch.randn(9, 4, 2, 64, generator=g, device=device).to(dtype) for _ in range(2)]
    q = (torch.randn(4, 4, 64, generator=g, device=device) * (4 if capped else 1)).to(dtype)  # the cap bites
    # the last two sequences share their first block (read once by the shared pass)
    tables = torch.tensor([[0, 1, 2], [3, 4, 5], [6, 7, 8], [6, 1, 2]], device=device)
    lens = torch.tensor([1, 7, 12, 9], device=device)
    shared = SharedPrefixTensors(torch.tensor([0, 0, 4, 4], device=device), torch.tensor([[4, 2, 3]], device=device))
    options = {"window": 5 if windowed else None, "softcap": 2.0 if capped else None}
    variant = " with a sliding window" * windowed + " with a logit soft-cap" * capped
    what = (f"the shared-prefix pass of the Triton decode attention{variant}" if shared_pass
            else f"the Triton decode attention{variant}")
    instead = ("reading every sequence's blocks itself" if shared_pass
               else "such layers use the slower gather path")
    try:
        got = decode_attention_triton(q, *pools, tables, lens, 0.125, shared=shared if shared_pass else None,
                                      **options).float()
    except Exception as exc:  # noqa: BLE001 -- any compile or launch failure means: use the path that works
        logger.warning("%s does not run on %s (%s); %s", what, device, exc, instead)
        return False
    expected = decode_attention_gather(q.float(), pools[0].float(), pools[1].float(), tables, lens, 0.125, **options)
    if not torch.allclose(got, expected, rtol=2e-2, atol=2e-2):
        logger.warning("%s disagrees with the gather path on %s; %s", what, device, instead)
        return False
    return True
