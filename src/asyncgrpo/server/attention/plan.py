"""The execution plan: which backend computes each kind of segment for each layer variant, chosen once.

    resolve_plan(model, cache, device, flags)            at load, before any step or graph capture
        model_probe(...)    the device, the model's heads and layer variants (window, soft-cap), the flags
                            and the shared pass's members per group (0: no shared pass)
        probe_plan(probe)   for each line of KINDS, per variant, the first backend that serves it
        plan.warm_up(cache) the chosen Triton kernels compiled (nothing compiles mid-serving)
    self_check.check_plan   the engine under the plan computes what the model computes, else the plan's
                            `downgraded()` one (packed prompt chunks -> padded) is checked and served

After that nothing probes or changes the plan: the runner lays out each step through it (`attention`:
the step's segments, in token order), the attention function runs each segment's backend per layer
(`kv_cache.paged_attention_forward`), and the CUDA graphs key their captures by it (`graph_key`).

Choosing a kind's backends: each variant of the model's layers takes the first backend of the kind's
line that serves it (declared support, then its load-time check). A step lays a kind out once for every
layer, so backends that read different layouts cannot share a kind: then the first backend that serves
every variant is taken for all. A kind with no backend for some variant is off (an optional layout:
the shared pass, rows); the mandatory ones end in a backend that serves everything.

A new layout is one file (its backend: support, `claims`, `build`, `forward`) and one line in KINDS.

Costs: the load-time checks run once per process, device, dtype and variant (cached: a second engine in
the process, or the downgraded plan, asks them again for free); the warm-up compiles each chosen Triton
kernel (seconds on a fresh machine, a moment from Triton's cache). Per step, laying the segments out is
host work once for all layers; per layer, each segment costs a dictionary lookup before its backend runs.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import TYPE_CHECKING, NamedTuple

import numpy as np
import torch

from asyncgrpo.server.attention.base import (
    CONTINUED,
    DECODE,
    FRESH,
    ROWS,
    SHARED,
    AttentionBackend,
    Chunks,
    DecodeSegment,
    PlanFlags,
    Probe,
    Segment,
    StepAttention,
    Variant,
)
from asyncgrpo.server.attention.continued import FlashContinued, PaddedContinued, ReferencePackedContinued
from asyncgrpo.server.attention.decode import GatherDecode, TritonDecode
from asyncgrpo.server.attention.fresh import FlashFresh, PaddedFresh, ReferencePackedFresh
from asyncgrpo.server.attention.rows import ContinuedRows
from asyncgrpo.server.attention.shared_prefix import (
    GatherSharedDecode,
    SharedPrefixes,
    TritonSharedDecode,
    max_members,
    shared_pass_works_on,
)
from asyncgrpo.server.attention.varlen import VarlenChunks
from asyncgrpo.server.attention_math import attention_variants
from asyncgrpo.server.host_copy import to_device

if TYPE_CHECKING:
    from asyncgrpo.server.kv_cache import PagedKVCache

logger = logging.getLogger(__name__)

ALL_VARIANTS: frozenset[Variant] = frozenset((w, c) for w in (False, True) for c in (False, True))
AUTO = PlanFlags()  # every choice left to the probe


def _has_shared_pass(probe: Probe) -> bool:
    return probe.shared_members >= 2


@dataclass(frozen=True)
class Kind:
    """One line of the probe: a segment kind, its backends best first, whether it is used at all, and
    whether it lays out prompt chunks (the prompt kinds take a step's chunks in the order of KINDS)."""

    name: str
    backends: tuple[type[AttentionBackend], ...]
    when: Callable[[Probe], bool] = field(default=lambda probe: True)
    prompt: bool = False


KINDS: tuple[Kind, ...] = (
    Kind(DECODE, (TritonDecode, GatherDecode)),
    Kind(SHARED, (TritonSharedDecode, TritonDecode, GatherSharedDecode, GatherDecode), when=_has_shared_pass),
    Kind(FRESH, (FlashFresh, ReferencePackedFresh, PaddedFresh), prompt=True),
    Kind(ROWS, (ContinuedRows,), when=_has_shared_pass, prompt=True),
    Kind(CONTINUED, (FlashContinued, ReferencePackedContinued, PaddedContinued), prompt=True),
)
MANDATORY = frozenset({DECODE, FRESH, CONTINUED})


class GraphKey(NamedTuple):
    """What a captured forward graph is keyed by (`step_graphs.StepGraphs`), each a bucket."""

    rows: int  # rows of the step (a batch bucket)
    blocks: int  # block-table columns its decode attention reads through
    groups: int  # group entries of the shared pass (0: none)
    adapters: bool  # rows with a LoRA adapter (the graph adds every slot's delta)


def model_probe(model: torch.nn.Module, cache: PagedKVCache, device: torch.device,
                flags: PlanFlags = AUTO) -> Probe:
    """What the plan is resolved from, read off the model and its KV cache. The shared pass is on where
    asked, or (auto) on CUDA where its Triton check passes; its members per group entry: as many as the
    kernel's tile holds (`shared_prefix.max_members`), 0 where that is fewer than two."""
    text = model.config.get_text_config()
    heads, kv_heads = getattr(text, "num_attention_heads", 0), cache.num_kv_heads
    dtype = cache.k[0].dtype
    wanted = flags.shared_prefix
    if wanted is None:
        wanted = device.type == "cuda" and shared_pass_works_on(device, dtype)
    return Probe(device, dtype, heads, kv_heads, cache.head_dim, frozenset(attention_variants(model)), flags,
                 max_members(heads, kv_heads) if wanted and heads else 0)


def resolve_plan(model: torch.nn.Module, cache: PagedKVCache, device: torch.device,
                 flags: PlanFlags = AUTO) -> ExecutionPlan:
    """The plan for `model` over `cache` on `device`, its kernels compiled; logged once. ValueError where
    the flags insist on a layout the model's layers refuse."""
    plan = probe_plan(model_probe(model, cache, device, flags))
    plan.warm_up(cache)
    logger.info("execution plan: %s", plan.describe())
    return plan


def _choose(kind: Kind, probe: Probe, variants: Sequence[Variant]) -> dict[Variant, AttentionBackend] | None:
    """Per variant, the first backend of `kind` that serves it; None where the kind is off."""
    if not kind.when(probe):
        return None
    picks = {v: next((b for b in kind.backends if b.serves(probe, v)), None) for v in variants}
    if any(b is None for b in picks.values()):
        return None
    if len({b.reads for b in picks.values()}) > 1:  # one layout per step: a backend serving every variant
        common = next((b for b in kind.backends if all(b.serves(probe, v) for v in variants)), None)
        if common is None:
            return None
        picks = dict.fromkeys(variants, common)
    made: dict[type, AttentionBackend] = {}
    return {v: made.setdefault(b, b(probe)) for v, b in picks.items()}


def probe_plan(probe: Probe) -> ExecutionPlan:
    """Resolve every line of KINDS for the probe's variants (all four where the model's attention
    modules were not found: its layers may pass either option)."""
    variants = sorted(probe.variants or ALL_VARIANTS)
    backends = {}
    for kind in KINDS:
        chosen = _choose(kind, probe, variants)
        if chosen is not None:
            backends[kind.name] = chosen
        elif kind.name in MANDATORY:
            raise RuntimeError(f"no attention backend computes {kind.name!r} segments here ({probe})")
    plan = ExecutionPlan.assemble(probe, backends)
    if probe.flags.packed_prompts and not plan.packed_prompts:
        raise ValueError("packed prompt chunks (packed_prompts=True) have no soft-capped attention: this "
                         "model's layers soft-cap their logits; leave packed_prompts unset")
    return plan


@dataclass(frozen=True, eq=False)
class ExecutionPlan:
    """The backends of every segment kind and layer variant, and what follows from them (see the module
    docstring). Frozen: `downgraded` and `with_backend` make new plans."""

    probe: Probe
    backends: Mapping[str, Mapping[Variant, AttentionBackend]]  # read-only
    prompt_kinds: tuple[str, ...]  # the kinds that lay out prompt chunks, in the order they take them
    unsplit_rows: int | None  # graph steps of this many rows on take the whole block table (None: never)

    @classmethod
    def assemble(cls, probe: Probe,
                 backends: Mapping[str, Mapping[Variant, AttentionBackend]]) -> ExecutionPlan:
        """The plan of these backends (read-only from here on) and what follows from them."""
        prompt = tuple(k.name for k in KINDS if k.prompt and k.name in backends)
        decode = set(map(type, backends[DECODE].values()))
        # the Triton kernel never splits a context from so many rows on (the gather reads what a table holds)
        unsplit = TritonDecode.unsplit_rows(probe) if decode == {TritonDecode} else None
        frozen = MappingProxyType({kind: MappingProxyType(dict(chosen)) for kind, chosen in backends.items()})
        return cls(probe, frozen, prompt, unsplit)

    @property
    def device(self) -> torch.device:
        return self.probe.device

    @property
    def shared_members(self) -> int:
        """Members per group entry of the shared pass (0: decode rows never look for shared blocks)."""
        return self.probe.shared_members if SHARED in self.backends else 0

    @property
    def rows(self) -> ContinuedRows | None:
        """The rows layout of short continued chunks, where it is on."""
        return next(iter(self.backends[ROWS].values())) if ROWS in self.backends else None

    @property
    def row_members(self) -> int:
        """Rows per run of the rows layout (0: it is off)."""
        return 0 if self.rows is None else self.rows.members

    @property
    def packed_prompts(self) -> bool:
        """Whether prompt chunks stay packed (FlashAttention's variable-length layout)."""
        return all(b.reads is VarlenChunks for b in self.backends[FRESH].values())

    @property
    def prompt_attention(self) -> str:
        """How prompt chunks attend, in `--prompt-attention`'s words (/server_info reports it)."""
        return "flash_varlen" if self.packed_prompts else "padded"

    @property
    def graphs_capture(self) -> bool:
        """Whether CUDA graphs may capture a step of decode rows (every backend of those kinds says so)."""
        decode = [b for kind in (DECODE, SHARED) for b in self.backends.get(kind, {}).values()]
        return all(b.support.graphs for b in decode)

    def backend(self, kind: str, variant: Variant) -> AttentionBackend:
        return self.backends[kind][variant]

    def attention(
        self,
        cache: PagedKVCache,
        slot_mapping: np.ndarray | Sequence[int],
        decode_tables: torch.Tensor | np.ndarray | None,
        decode_lens: Sequence[int] | np.ndarray,
        prefill_lens: Sequence[int],
        prefill_starts: Sequence[int] | None = None,
        prefill_tables: Sequence[Sequence[int]] | np.ndarray | None = None,
        decode_shared: SharedPrefixes | None = None,
    ) -> StepAttention:
        """A step's segments from host data, in token order: the decode rows (decode_tables: CPU int64
        [Bd, nb], entries past a sequence's blocks ignored through decode_lens; decode_shared: their groups
        sharing first blocks), then the prompt chunks, each computing tokens [start, start + len) of its
        sequence over its blocks `prefill_tables` (prefill_starts None: all from token 0), taken by the
        prompt kinds in order (the scheduler puts those from token 0 first)."""
        device = self.device
        segments: list[Segment] = []
        if len(decode_lens):
            segments.append(DecodeSegment(
                len(decode_lens), to_device(decode_tables, device),
                to_device(np.asarray(decode_lens, dtype=np.int64), device),
                None if decode_shared is None else decode_shared.to(device)))
        if len(prefill_lens):
            lens = np.asarray(prefill_lens, dtype=np.int64)
            starts = np.zeros_like(lens) if prefill_starts is None else np.asarray(prefill_starts, np.int64)
            chunks, at = Chunks(lens, starts, prefill_tables), 0
            for kind in self.prompt_kinds:
                layout = next(iter(self.backends[kind].values()))
                n = layout.claims(chunks[at:]) if at < len(chunks) else 0
                if n:
                    segments.append(layout.build(chunks[at: at + n], cache, device))
                    at += n
            assert at == len(chunks), "every prompt chunk has a layout"
        slots = to_device(np.asarray(slot_mapping, dtype=np.int64), device)
        return StepAttention(cache, slots, segments, self.backends)

    def graph_key(self, rows: int, blocks: int, groups: int, adapters: bool, max_blocks: int) -> GraphKey:
        """The graph a step of decode rows replays: `rows` (a batch bucket), `blocks` table columns it
        writes (a power of two), `groups` group entries (a bucket). From `unsplit_rows` rows on, the
        decode attention never splits a context, so the graph takes the whole table and serves every
        context length: fewer graphs, fewer mid-run captures as contexts grow; smaller steps take the
        width that covers their contexts, which sizes their splits. Without the shared pass there are
        no group entries."""
        if self.unsplit_rows is not None and rows >= self.unsplit_rows:
            blocks = max_blocks
        return GraphKey(rows, blocks, groups if self.shared_members else 0, adapters)

    def downgraded(self) -> ExecutionPlan | None:
        """The plan to serve when this one fails the self-check: packed prompt chunks padded instead
        (where the flags left the choice to the probe); None: nothing left to give up."""
        if not self.packed_prompts or self.probe.flags.packed_prompts is not None:
            return None
        return probe_plan(replace(self.probe, flags=replace(self.probe.flags, packed_prompts=False)))

    def with_backend(self, kind: str, backend: type[AttentionBackend]) -> ExecutionPlan:
        """This plan with `backend` computing every variant of `kind` (benchmarks compare backends)."""
        made = backend(self.probe)
        backends = {**self.backends, kind: dict.fromkeys(self.backends[kind], made)}
        return ExecutionPlan.assemble(self.probe, backends)

    def warm_up(self, cache: PagedKVCache) -> None:
        """Compile each chosen backend's kernels for the variants it serves."""
        if not self.probe.num_heads:
            return
        start, done = time.perf_counter(), set()
        for chosen in self.backends.values():
            for variant, backend in chosen.items():
                if (id(backend), variant) not in done:
                    done.add((id(backend), variant))
                    backend.warm_up(cache, variant)
        if self.device.type == "cuda":  # seconds on a fresh machine, a moment once Triton's cache holds them
            logger.info("attention kernels compiled in %.1f s", time.perf_counter() - start)

    def describe(self) -> str:
        """One line: each kind's backends, by variant where they differ."""
        names = {(False, False): "plain", (True, False): "windowed", (False, True): "soft-capped",
                 (True, True): "windowed soft-capped"}
        parts = []
        for kind, chosen in self.backends.items():
            by = {}
            for variant, backend in sorted(chosen.items()):
                by.setdefault(backend.name, []).append(names[variant])
            text = ", ".join(n if len(by) == 1 else f"{n} ({' / '.join(v)})" for n, v in by.items())
            parts.append(f"{kind}: {text}")
        if self.row_members:
            parts.append(f"runs of {self.row_members} rows")
        return "; ".join(parts)
