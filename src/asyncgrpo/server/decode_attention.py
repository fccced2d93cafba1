"""Decode attention over the paged KV cache: one new query token per sequence.

Two implementations of one function:

- `decode_attention_gather` (any device): gathers each sequence's blocks into a dense
  [B, L, kv_heads, D] copy and runs SDPA with a length mask. Simple, but every step copies the
  padded cache of every layer (L is the longest context rounded up to a block bucket), which on a
  GPU costs more memory traffic than the attention itself.
- `decode_attention_triton` (CUDA with Triton; the kernels are in `decode_kernels.py`): one program per (sequence, kv head, context split)
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
import time

import torch

from asyncgrpo.server.attention_math import attend, in_window
from asyncgrpo.server.decode_kernels import _triton_kernels, decode_attention_triton
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
    windowed, capped = window is not None, bool(softcap)
    if q.is_cuda and triton_serves(q.device, q.dtype, q.shape[-1], windowed, capped):
        if windowed or (shared is not None and not shared_pass_works_on(q.device, q.dtype, capped)):
            shared = None
        return decode_attention_triton(q, k_pool, v_pool, block_tables, context_lens, scale, shared=shared,
                                       window=window, softcap=softcap)
    if not windowed and not capped and shared is not None:
        return decode_attention_shared_gather(q, k_pool, v_pool, block_tables, context_lens, scale, shared)
    return decode_attention_gather(q, k_pool, v_pool, block_tables, context_lens, scale, window, softcap)


def triton_serves(device: torch.device, dtype: torch.dtype, head_dim: int, windowed: bool = False,
                  capped: bool = False) -> bool:
    """Whether `decode_attention` runs the Triton kernel for this variant (else the gather path)."""
    return head_dim >= 16 and head_dim & (head_dim - 1) == 0 and triton_works_on(device, dtype, windowed, capped)


@functools.cache
def triton_works_on(device: torch.device, dtype: torch.dtype, windowed: bool = False, capped: bool = False) -> bool:
    """Whether the Triton kernel's variant (with a sliding window, with a soft-cap) compiles on this
    device and matches the gather path on random input (once per device, dtype and variant; call it
    outside CUDA-graph capture: `StepGraphs` checks its model's variants before it captures any)."""
    return _triton_matches_gather(device, dtype, shared_pass=False, windowed=windowed, capped=capped)


@functools.cache
def shared_pass_works_on(device: torch.device, dtype: torch.dtype, capped: bool = False) -> bool:
    """The same check for the shared-prefix pass (`shared_prefix.py`, layers without a window); where it
    fails, decode attention keeps the plain Triton kernel and reads every sequence's blocks itself."""
    return triton_works_on(device, dtype, False, capped) and _triton_matches_gather(
        device, dtype, shared_pass=True, windowed=False, capped=capped)


def check_decode_variants(device: torch.device, dtype: torch.dtype, variants: set[tuple[bool, bool]]) -> None:
    """Run the checks of the (windowed, capped) variants a model's layers use, and of the shared pass of
    those without a window, now (before any CUDA graph is captured; without graphs they run at first use)."""
    shared_pass_works_on(device, dtype)  # the runner decides on the shared pass from the plain variant
    for windowed, capped in sorted(variants):
        if windowed:
            triton_works_on(device, dtype, windowed, capped)
        else:
            shared_pass_works_on(device, dtype, capped)


def compile_decode_kernels(k_pool: torch.Tensor, v_pool: torch.Tensor, scratch_block: int, num_heads: int,
                           variants: set[tuple[bool, bool]], shared_members: int) -> None:
    """Launch each Triton decode-attention kernel the model's steps can run once, on the KV cache's scratch
    block: one split and several, with the shared-prefix pass (groups of `shared_members`) and without,
    for each (windowed, capped) variant of its layers. Their split counts are run-time arguments, so
    these few compiled kernels serve every step, and none compiles (~1 s) in the middle of serving."""
    start = time.perf_counter()
    device, dtype = k_pool.device, k_pool.dtype
    _, block_size, _, head_dim = k_pool.shape
    q = torch.zeros(2, num_heads, head_dim, dtype=dtype, device=device)
    tables = torch.full((2, 2), scratch_block, dtype=torch.int64, device=device)
    lens = torch.full((2,), block_size + 1, dtype=torch.int64, device=device)
    for windowed, capped in sorted(variants):
        if not triton_serves(device, dtype, head_dim, windowed, capped):
            continue
        options = {"window": block_size if windowed else None, "softcap": 30.0 if capped else None}
        for num_splits in (1, 2):
            decode_attention_triton(q, k_pool, v_pool, tables, lens, 1.0, num_splits=num_splits, **options)
        if shared_members and not windowed and shared_pass_works_on(device, dtype, capped):
            groups = torch.full((1, 1 + shared_members), -1, dtype=torch.int64, device=device)
            groups[0, :3] = torch.tensor([block_size, 0, 1])
            shared = SharedPrefixTensors(torch.full((2,), block_size, dtype=torch.int64, device=device), groups)
            decode_attention_triton(q, k_pool, v_pool, tables, lens, 1.0, num_splits=1, shared=shared,
                                    num_shared_splits=2, **options)
    # seconds on a fresh machine, a moment once Triton's on-disk cache holds them
    logger.info("decode-attention kernels compiled in %.1f s", time.perf_counter() - start)


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
