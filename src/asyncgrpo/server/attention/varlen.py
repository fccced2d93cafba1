"""The packed layout of prompt chunks and FlashAttention's variable-length kernel, which the packed
backends of `fresh.py` and `continued.py` run.

The padded layouts (`fresh.PaddedFresh`, `continued.continued_layout`) copy the
step's prompts into a [B, Lmax] batch and attend with a mask: a dozen operators per layer (gathers,
a mask, copies for the grouped heads, SDPA below its unmasked rate, the way back), which leave the
GPU waiting for the host on steps with prompt tokens. Here every chunk's queries stay packed, and one
call of PyTorch's FlashAttention (`aten._flash_attention_forward` with cumulative lengths, which takes
grouped heads as they are) attends per layer:

    fresh chunks (from token 0)   over their own keys, as the step computed them (nothing copied)
    continued chunks              over their context read from the paged cache into one packed run of
                                  keys per chunk (its cached tokens, then its own, written this step)

Each chunk's queries are aligned to the end of its keys (query i of an L-token chunk over S keys sees
keys 0 .. S - L + i, FlashAttention's causal rule), within the layer's sliding window (transformers':
keys p - window < j <= p, FlashAttention's left window of window - 1). No kernel of it soft-caps: a
model with a capped layer keeps the padded layouts.

`varlen_works_on` says where the kernel runs (CUDA, fp16/bf16, the model's head dim), checked once
against `varlen_reference` on random chunks. The reference computes the same thing one chunk at a time
with `attend`; the plan takes it only where asked to (`PlanFlags.packed_prompts=True`: CPU tests of
these layouts), never by default.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from asyncgrpo.server.attention.base import (
    CONTINUED,
    FRESH,
    HALF,
    Probe,
    Support,
    Variant,
    chunk_positions,
    padded_tables,
)
from asyncgrpo.server.attention_math import attend, in_window
from asyncgrpo.server.host_copy import to_device

logger = logging.getLogger(__name__)


@dataclass
class VarlenChunks:
    """Packed layout of prompt chunks (device tensors unless noted)."""

    lens: list[int]  # host: new tokens (queries) of each chunk, in order
    key_lens: list[int]  # host: keys each chunk attends over (its start + its length)
    cu_q: torch.Tensor  # [B + 1] int32: where each chunk's queries start in the packed queries
    cu_k: torch.Tensor  # [B + 1] int32: the same for the packed keys
    key_slots: torch.Tensor | None  # [sum(key_lens)] int64 cache rows of every chunk's keys; None: fresh
    # host: the longest chunk's queries and keys (FlashAttention sizes its grid by them)
    max_q: int = field(init=False)
    max_k: int = field(init=False)

    def __post_init__(self) -> None:
        self.max_q, self.max_k = max(self.lens), max(self.key_lens)

    @property
    def num_tokens(self) -> int:
        return sum(self.lens)

    @property
    def kind(self) -> str:
        """fresh: chunks from token 0 over their own keys; continued: over keys read from the cache."""
        return FRESH if self.key_slots is None else CONTINUED


def varlen_chunks(
    lens: Sequence[int],
    starts: Sequence[int],
    tables: Sequence[Sequence[int]] | np.ndarray | None,
    block_size: int,
    device: torch.device,
) -> VarlenChunks:
    """Layout of chunks computing tokens [start, start + len) of their sequences. All from token 0
    (fresh): their keys are their own, `tables` unused. Else `tables` (block lists, or the scheduler's
    [B, >= nb] rows) give where every chunk's keys live in the cache."""
    lens_arr, starts_arr = np.asarray(lens, dtype=np.int64), np.asarray(starts, dtype=np.int64)
    key_lens = starts_arr + lens_arr
    cum = np.zeros((2, len(lens_arr) + 1), dtype=np.int32)
    cum[0, 1:], cum[1, 1:] = np.cumsum(lens_arr), np.cumsum(key_lens)
    key_slots = None
    if starts_arr.any():
        blocks = padded_tables(tables, key_lens, block_size, 0)
        p = chunk_positions(key_lens, np.zeros_like(key_lens))
        seq = np.repeat(np.arange(len(key_lens)), key_lens)
        key_slots = to_device(blocks[seq, p // block_size] * block_size + p % block_size, device)
    cum = to_device(cum, device)
    return VarlenChunks(lens=lens_arr.tolist(), key_lens=key_lens.tolist(), cu_q=cum[0], cu_k=cum[1],
                        key_slots=key_slots)


def cached_keys(pool: torch.Tensor, part: VarlenChunks) -> torch.Tensor:
    """[sum(key_lens), KVH, D]: every continued chunk's keys (or values) read from one layer's pool
    [num_blocks, block_size, KVH, D], in which this step's own are written already."""
    return pool.view(-1, pool.shape[2], pool.shape[3]).index_select(0, part.key_slots)


def flash_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, part: VarlenChunks, scale: float,
                 window: int | None = None) -> torch.Tensor:
    """Packed q [Tq, H, D], k/v [Tk, KVH, D] (last dim contiguous; CUDA, half precision) -> [Tq, H, D]
    through FlashAttention's variable-length kernel."""
    out = torch.ops.aten._flash_attention_forward(
        q, k, v, part.cu_q, part.cu_k, part.max_q, part.max_k, 0.0, True, False, scale=scale,
        window_size_left=-1 if window is None else window - 1, window_size_right=0,
    )
    return out[0]


def varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, part: VarlenChunks, scale: float,
           window: int | None = None) -> torch.Tensor:
    """`flash_varlen` on a CUDA half-precision input, `varlen_reference` otherwise (the check's and the
    tests' entry: the backends call the one the plan took)."""
    if q.is_cuda and q.dtype in HALF:
        return flash_varlen(q, k, v, part, scale, window)
    return varlen_reference(q, k, v, part.lens, part.key_lens, scale, window)


def varlen_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lens: Sequence[int],
                     key_lens: Sequence[int], scale: float, window: int | None = None) -> torch.Tensor:
    """What `varlen` computes, one chunk at a time through `attend` (any device and dtype)."""
    out, qi, ki = [], 0, 0
    for n, s in zip(lens, key_lens):
        pos = torch.arange(s - n, s, device=q.device)[:, None]  # each query's position
        keys = torch.arange(s, device=q.device)[None, :]
        mask = (keys <= pos) & in_window(pos, keys, window)

        def heads_first(x: torch.Tensor, a: int, b: int) -> torch.Tensor:
            return x[a:b].transpose(0, 1)[None]

        o = attend(heads_first(q, qi, qi + n), heads_first(k, ki, ki + s), heads_first(v, ki, ki + s), mask,
                   scale)
        out.append(o[0].transpose(0, 1))
        qi, ki = qi + n, ki + s
    return torch.cat(out)


def flash_serves(probe: Probe, variant: Variant) -> bool:
    """The packed backends' check: never with `packed_prompts=False`, without the check when insisted on,
    else where `varlen_works_on` passes for the layer's variant."""
    flag = probe.flags.packed_prompts
    if flag is not None:
        return flag
    return bool(probe.num_heads) and varlen_works_on(probe.device, probe.dtype, probe.num_heads,
                                                     probe.num_kv_heads, probe.head_dim, variant[0])


@functools.cache
def varlen_works_on(device: torch.device, dtype: torch.dtype, num_heads: int, num_kv_heads: int,
                    head_dim: int, windowed: bool = False) -> bool:
    """Whether FlashAttention's variable-length kernel runs this shape on `device` and computes what
    `varlen_reference` computes (`varlen_check_error`). Once per device, dtype, shape and variant."""
    if device.type != "cuda" or dtype not in HALF:
        return False
    try:
        err = varlen_check_error(device, dtype, num_heads, num_kv_heads, head_dim, windowed)
    except Exception as exc:  # noqa: BLE001 -- an older build, a head dim or GPU the kernel does not take
        logger.info("FlashAttention's variable-length kernel does not run here (%s): prompt chunks are "
                    "padded", exc)
        return False
    if not err <= (0.02 if dtype == torch.float16 else 0.06):
        logger.warning("FlashAttention's variable-length kernel differs from the reference by %.3g on this "
                       "GPU: prompt chunks are padded instead", err)
        return False
    return True


def varlen_check_error(device: torch.device, dtype: torch.dtype, num_heads: int, num_kv_heads: int,
                       head_dim: int, windowed: bool = False) -> float:
    """Max |varlen - reference| over random chunks laid out as a step lays them out: prompts from token 0
    over their own keys, all three strided views of one joined q/k/v projection (a chunk of one token,
    one longer than the window); chunks after cached keys over gathered (contiguous) keys; and chunks of
    one token only (FlashAttention takes another path when no chunk has two queries)."""
    g = torch.Generator(device="cpu").manual_seed(0)
    window = 24 if windowed else None
    h, kvh, d = num_heads, num_kv_heads, head_dim
    lens = [5, 1, 37, 70]
    # the fused q/k/v projection
    joined = torch.randn(sum(lens), (h + 2 * kvh) * d, generator=g).to(device, dtype)
    queries, own_k, own_v = (joined[:, a * d: b * d].view(-1, b - a, d)
                             for a, b in ((0, h), (h, h + kvh), (h + kvh, h + 2 * kvh)))

    def gathered(n: int) -> torch.Tensor:
        return torch.randn(n, kvh, d, generator=g).to(device, dtype)

    cases = [(queries, own_k, own_v, lens, lens),
             (queries, gathered(232), gathered(232), lens, [5, 40, 37, 150]),
             (queries[:2], gathered(190), gathered(190), [1, 1], [40, 150])]
    worst = 0.0
    for q, k, v, n, key_lens in cases:
        cum = torch.tensor([[0, *np.cumsum(n)], [0, *np.cumsum(key_lens)]], dtype=torch.int32, device=device)
        part = VarlenChunks(n, key_lens, cum[0], cum[1], None)
        got = varlen(q, k, v, part, d**-0.5, window).float()
        want = varlen_reference(q.float(), k.float(), v.float(), n, key_lens, d**-0.5, window)
        worst = max(worst, float((got - want).abs().max()))
    return worst


class ReferencePacked:
    """Mixin of the packed backends of `fresh.py` and `continued.py`: the packed layout computed through
    `varlen_reference` (any device), taken only where `PlanFlags.packed_prompts=True` (CPU tests)."""

    name = "packed_reference"
    support = Support(softcap=False)

    @classmethod
    def check(cls, probe: Probe, variant: Variant) -> bool:
        return probe.flags.packed_prompts is True

    def packed(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segment: VarlenChunks, scale: float,
               window: int | None) -> torch.Tensor:
        return varlen_reference(q, k, v, segment.lens, segment.key_lens, scale, window)
