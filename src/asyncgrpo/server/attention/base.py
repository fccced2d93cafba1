"""What every attention backend is: the segments of a step, what a backend declares, and its interface.

A step is one flat row of T tokens (decode tokens first, then the prompt chunks); its attention is a
list of segments, each a run of those tokens in one layout, computed by one backend per layer:

    kind            tokens                                          layout (`Segment`)
    decode          one query per decode sequence (or graph row)    `DecodeSegment`: block tables, lengths
    decode_shared   the same, groups sharing their first blocks     `DecodeSegment` with `shared` groups
    fresh           prompt chunks from token 0                      packed (`VarlenChunks`) or padded
    rows            continued chunks short enough to be decode      `DecodeSegment` (its kind: decode or
                    rows (a layout only: decode backends compute)   decode_shared)
    continued       chunks after cached tokens                      packed (`VarlenChunks`) or padded

The prompt layouts share the host-side index arithmetic of `Chunks` (each chunk token's position, the
indices between packed tokens and a padded batch, block tables cut to what each chunk reads).

A backend (`AttentionBackend`) declares what it runs (`Support`: device types, dtypes, sliding windows,
soft-caps, CUDA-graph capture), may add a load-time check (`check`: it compiles and agrees with a
reference), builds its segment from the step's host data (`claims` / `build`, prompt kinds) and computes
it per layer (`forward`). The plan (`plan.py`) picks one backend per kind and layer variant once, at
load; nothing downstream probes again.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Protocol

import numpy as np
import torch

if TYPE_CHECKING:
    from asyncgrpo.server.kv_cache import PagedKVCache

# the segment kinds (see the module docstring)
DECODE = "decode"
SHARED = "decode_shared"
FRESH = "fresh"
ROWS = "rows"
CONTINUED = "continued"

# a layer's attention variant: (has a sliding window, has a logit soft-cap)
Variant = tuple[bool, bool]
ANY_DEVICE = frozenset({"cpu", "cuda"})
HALF = (torch.float16, torch.bfloat16)


def variant_of(window: int | None, softcap: float | None) -> Variant:
    return window is not None, bool(softcap)


@dataclass(frozen=True)
class Support:
    """What a backend declares it runs; the plan takes it nowhere else (vLLM's backends declare the
    same: device types, dtypes, `AttentionCGSupport`)."""

    devices: frozenset[str] = ANY_DEVICE  # device types
    dtypes: tuple[torch.dtype, ...] | None = None  # None: every dtype
    windows: bool = True  # layers with a sliding window
    softcap: bool = True  # layers with a logit soft-cap
    graphs: bool = False  # a CUDA graph may capture its forward (fixed shapes, no host work per layer)

    def allows(self, device: torch.device, dtype: torch.dtype, variant: Variant) -> bool:
        windowed, capped = variant
        return (device.type in self.devices and (self.dtypes is None or dtype in self.dtypes)
                and (self.windows or not windowed) and (self.softcap or not capped))


@dataclass(frozen=True)
class PlanFlags:
    """What start-up asks of the plan. None: the probe decides (a fast path is taken where it runs and
    passes its check); True: insist (tests run a layout on the CPU through its reference computation);
    False: never.

    shared_prefix    decode attention reads the first blocks that sequences share (a GRPO group's prompt)
                     once per group (`shared_prefix.py`); auto: where the Triton shared pass runs
    continued_rows   short chunks after cached tokens run as rows of the decode attention (`rows.py`;
                     needs the shared pass); auto: where the Triton kernel runs every variant of the
                     model and none has a sliding window
    packed_prompts   prompt chunks stay packed for FlashAttention's variable-length kernel (`varlen.py`);
                     auto: where it runs and passes its check on every layer (none soft-capped); True
                     elsewhere: its reference computation
    """

    shared_prefix: bool | None = None
    continued_rows: bool | None = None
    packed_prompts: bool | None = None


@dataclass(frozen=True)
class Probe:
    """What a plan is resolved from: the device, the model's attention shapes and variants, the flags,
    and the members per group entry of the shared pass (0: no shared pass)."""

    device: torch.device
    dtype: torch.dtype
    num_heads: int  # query heads (0: the config does not say)
    num_kv_heads: int
    head_dim: int
    variants: frozenset[Variant]  # of the model's attention layers
    flags: PlanFlags = PlanFlags()
    shared_members: int = 0


class Segment(Protocol):
    """A run of a step's tokens in one layout."""

    @property
    def kind(self) -> str: ...

    @property
    def num_tokens(self) -> int: ...


@dataclass
class SharedPrefixTensors:
    """Groups of decode rows sharing their first blocks (`shared_prefix.SharedPrefixes`) on the device:
    lens [B] (tokens each row's group reads for it, 0: none) and groups [G, 1 + M] (per entry its shared
    tokens, then its members' row indices, -1 past them), int64."""

    lens: torch.Tensor
    groups: torch.Tensor


@dataclass
class DecodeSegment:
    """Rows of the paged decode attention: a decode sequence's new token, a graph step's row, or a
    short chunk's token (`rows.py`), each over its sequence's cached keys (device tensors unless noted)."""

    num_tokens: int  # host: rows
    block_tables: torch.Tensor  # [B, nb] int64 blocks of each row's sequence (past it: any valid block)
    context_lens: torch.Tensor  # [B] int64 keys each row sees, itself included
    shared: SharedPrefixTensors | None = None  # groups of rows sharing their first blocks (read once each)

    @property
    def kind(self) -> str:
        return DECODE if self.shared is None else SHARED


@dataclass(frozen=True)
class Chunks:
    """A step's prompt chunks on the host: chunk i computes tokens [starts[i], starts[i] + lens[i]) of its
    sequence, whose blocks are tables[i] (a block list, or a row of the scheduler's [B, >= nb] table)."""

    lens: np.ndarray  # [B] int64
    starts: np.ndarray  # [B] int64
    tables: Sequence[Sequence[int]] | np.ndarray | None  # None: every chunk starts at token 0

    def __len__(self) -> int:
        return len(self.lens)

    def __getitem__(self, part: slice) -> Chunks:
        return Chunks(self.lens[part], self.starts[part], None if self.tables is None else self.tables[part])


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


class AttentionBackend:
    """One way of computing one kind of segment. Subclasses set `kind`, `name` and `support`, and `reads`
    (the segment type their forward takes: backends of one kind that read the same layout may serve
    different layer variants in one step). Instances are made once by the plan from the `Probe`."""

    kind: ClassVar[str]
    name: ClassVar[str]
    support: ClassVar[Support] = Support()
    reads: ClassVar[type]

    def __init__(self, probe: Probe) -> None:
        self.probe = probe

    @classmethod
    def serves(cls, probe: Probe, variant: Variant) -> bool:
        """Whether the plan may take this backend for layers of `variant`: its declared support, then its
        load-time check."""
        return cls.support.allows(probe.device, probe.dtype, variant) and cls.check(probe, variant)

    @classmethod
    def check(cls, probe: Probe, variant: Variant) -> bool:
        """Load-time check beyond the declared support (compiles, agrees with a reference); cached by
        whatever it runs, never called after the plan is resolved."""
        return True

    def claims(self, chunks: Chunks) -> int:
        """Prompt kinds: how many of the leading `chunks` this layout takes (the plan offers the step's
        chunks to the prompt kinds in order, each taking a leading run)."""
        raise NotImplementedError(f"{type(self).__name__} lays out no prompt chunks")

    def build(self, chunks: Chunks, cache: PagedKVCache, device: torch.device) -> Segment:
        """Prompt kinds: the segment of `chunks` (host work, once per step; every layer reuses it)."""
        raise NotImplementedError(f"{type(self).__name__} lays out no prompt chunks")

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_pool: torch.Tensor,
                v_pool: torch.Tensor, segment: Segment, scale: float, window: int | None,
                softcap: float | None) -> torch.Tensor:
        """One layer: q [H, T, D], k/v [KVH, T, D] of the segment's tokens (their keys/values are in the
        pools [num_blocks, block_size, KVH, D] already) -> [T, H, D]."""
        raise NotImplementedError(f"{type(self).__name__} computes no segment itself")

    def warm_up(self, cache: PagedKVCache, variant: Variant) -> None:
        """Compile what layers of `variant` will run, once at load (nothing compiles mid-serving)."""

    def __repr__(self) -> str:
        return self.name


@dataclass
class StepAttention:
    """What the attention function needs for one step: the cache, where each token's keys go, and the
    step's segments in token order, with the plan that computes them (`kv_cache.paged_attention_forward`)."""

    cache: PagedKVCache
    slot_mapping: torch.Tensor  # [T] int64: flat cache row of every token of the step
    segments: list[Segment]
    backends: Mapping[str, Mapping[Variant, AttentionBackend]]  # the plan's, by kind and layer variant
