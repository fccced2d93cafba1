"""Segment kind `decode`: paged decode attention, one query row per sequence over its cached keys.

Two backends compute it:

- `TritonDecode` (CUDA with Triton; the kernels are in `decode_kernels.py`): one program per (sequence,
  kv head, context split) walks the block table and reads only the sequence's own cached rows once, with
  an online softmax in float32; small batches split the context so that every multiprocessor has work,
  and a second kernel merges the splits. A power-of-two head size; each (window, soft-cap) variant is
  checked once per device against the gather on random input (`triton_works_on`: e.g. older GPUs lack
  its bfloat16 dot) and compiled at load (`warm_up`), so nothing compiles in the middle of serving.
- `GatherDecode` (any device): gathers each sequence's blocks into a dense [B, L, kv_heads, D] copy
  and runs SDPA with a length mask. Simple, but every step copies the padded cache of every layer (L
  is the longest context rounded up to a block bucket), which on a GPU costs more memory traffic than
  the attention itself.

Both take a layer's sliding window (the Triton kernel starts at the first key the window reaches, so
it reads only those blocks) and logit soft-cap (Gemma 2), and CUDA graphs capture both. The plan takes
Triton for the variants whose check passed, the gather for the others (one layout: a step may mix them
across layers).
"""

from __future__ import annotations

import functools
import logging

import torch

from asyncgrpo.server.attention.base import (
    DECODE,
    AttentionBackend,
    DecodeSegment,
    Probe,
    SharedPrefixTensors,
    Support,
    Variant,
)
from asyncgrpo.server.attention_math import attend, in_window
from asyncgrpo.server.decode_kernels import _triton_kernels, decode_attention_triton, one_split_programs

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


class GatherDecode(AttentionBackend):
    """Decode rows through a dense copy of their blocks (any device, every variant). It ignores a
    segment's groups: as the fallback of `decode_shared` it reads every row's blocks itself."""

    kind = DECODE
    name = "gather"
    support = Support(graphs=True)
    reads = DecodeSegment

    def forward(self, q, k, v, k_pool, v_pool, segment: DecodeSegment, scale, window,
                softcap) -> torch.Tensor:
        return decode_attention_gather(q.transpose(0, 1), k_pool, v_pool, segment.block_tables,
                                       segment.context_lens, scale, window, softcap)


class TritonDecode(AttentionBackend):
    """Decode rows through the Triton kernel, each row's own blocks (groups ignored: as the fallback of
    `decode_shared` for windowed layers, whose group members at different lengths see different windows)."""

    kind = DECODE
    name = "triton"
    support = Support(devices=frozenset({"cuda"}), graphs=True)
    reads = DecodeSegment

    @classmethod
    def check(cls, probe: Probe, variant: Variant) -> bool:
        return triton_serves(probe.device, probe.dtype, probe.head_dim, *variant)

    def forward(self, q, k, v, k_pool, v_pool, segment: DecodeSegment, scale, window,
                softcap) -> torch.Tensor:
        return decode_attention_triton(q.transpose(0, 1), k_pool, v_pool, segment.block_tables,
                                       segment.context_lens, scale, window=window, softcap=softcap)

    def warm_up(self, cache, variant: Variant) -> None:
        """One split and several: their counts are run-time arguments, so two compiled kernels serve
        every step of this variant."""
        q, tables, lens = warm_up_rows(cache, self.probe.num_heads)
        for num_splits in (1, 2):
            decode_attention_triton(q, *first_pools(cache), tables, lens, 1.0, num_splits=num_splits,
                                    **warm_up_options(cache.block_size, variant))

    @staticmethod
    def unsplit_rows(probe: Probe) -> int:
        """Rows from which the kernel never splits a context (`decode_kernels.choose_splits`): a graph of
        such a step can take the whole block table and serve every context length."""
        cuda = probe.device.type == "cuda"  # (Triton's interpreter, CPU tests: one program at a time)
        sms = torch.cuda.get_device_properties(probe.device).multi_processor_count if cuda else 1
        return -(-one_split_programs(sms) // probe.num_kv_heads)


def triton_serves(device: torch.device, dtype: torch.dtype, head_dim: int, windowed: bool = False,
                  capped: bool = False) -> bool:
    """Whether the Triton kernel runs this variant here: a power-of-two head size and its check."""
    power_of_two = head_dim >= 16 and head_dim & (head_dim - 1) == 0
    return power_of_two and triton_works_on(device, dtype, windowed, capped)


@functools.cache
def triton_works_on(device: torch.device, dtype: torch.dtype, windowed: bool = False,
                    capped: bool = False) -> bool:
    """Whether the Triton kernel's variant (with a sliding window, with a soft-cap) compiles on this
    device and matches the gather path on random input (once per device, dtype and variant; the plan
    asks before any CUDA graph is captured)."""
    return triton_matches_gather(device, dtype, shared_pass=False, windowed=windowed, capped=capped)


def first_pools(cache) -> tuple[torch.Tensor, torch.Tensor]:
    """The K/V pools of the cache's first layer that keeps keys (a hybrid's recurrent layers keep none)."""
    layer = next(i for i, pool in enumerate(cache.k) if pool.numel())
    return cache.k[layer], cache.v[layer]


def warm_up_rows(cache, num_heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Two query rows over the cache's scratch block (what a warm-up launch reads and writes)."""
    k_pool, _ = first_pools(cache)
    device, dtype = k_pool.device, k_pool.dtype
    q = torch.zeros(2, num_heads, cache.head_dim, dtype=dtype, device=device)
    tables = torch.full((2, 2), cache.scratch_block, dtype=torch.int64, device=device)
    lens = torch.full((2,), cache.block_size + 1, dtype=torch.int64, device=device)
    return q, tables, lens


def warm_up_options(block_size: int, variant: Variant) -> dict:
    windowed, capped = variant
    return {"window": block_size if windowed else None, "softcap": 30.0 if capped else None}


def triton_matches_gather(device: torch.device, dtype: torch.dtype, shared_pass: bool, windowed: bool,
                           capped: bool) -> bool:
    if _triton_kernels() is None:
        return False
    g = torch.Generator(device=device).manual_seed(0)
    pools = [torch.randn(9, 4, 2, 64, generator=g, device=device).to(dtype) for _ in range(2)]
    q = (torch.randn(4, 4, 64, generator=g, device=device) * (4 if capped else 1)).to(dtype)  # the cap bites
    # the last two sequences share their first block (read once by the shared pass)
    tables = torch.tensor([[0, 1, 2], [3, 4, 5], [6, 7, 8], [6, 1, 2]], device=device)
    lens = torch.tensor([1, 7, 12, 9], device=device)
    shared = SharedPrefixTensors(torch.tensor([0, 0, 4, 4], device=device),
                                 torch.tensor([[4, 2, 3]], device=device))
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
    expected = decode_attention_gather(q.float(), pools[0].float(), pools[1].float(), tables, lens, 0.125,
                                       **options)
    if not torch.allclose(got, expected, rtol=2e-2, atol=2e-2):
        logger.warning("%s disagrees with the gather path on %s; %s", what, device, instead)
        return False
    return True
