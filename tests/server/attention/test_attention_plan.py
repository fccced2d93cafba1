"""The execution plan (`server/attention/plan.py`): which backend computes each segment kind for each layer
variant, chosen once from the device, the model and the flags; what follows from it (shared-pass members,
rows, graph keys, the self-check's downgrade); and that a new layout is one file plus one line of the
probe (`toy_layout.py`), which the plan and the model runner pick up with no other change."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

# the harness of tests/server/test_scheduler_prefix_caching.py
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "server"))
from test_scheduler_prefix_caching import BS, Harness, _assert_same, _prompt, tiny_qwen3
from toy_layout import LINE, ONE_TOKEN, OneTokenBackend

from asyncgrpo.server.attention import plan as plan_module
from asyncgrpo.server.attention.base import (
    CONTINUED,
    DECODE,
    FRESH,
    ROWS,
    SHARED,
    PlanFlags,
    Probe,
    Support,
)
from asyncgrpo.server.attention.continued import PaddedContinued, ReferencePackedContinued
from asyncgrpo.server.attention.decode import GatherDecode, TritonDecode
from asyncgrpo.server.attention.fresh import PaddedFresh, ReferencePackedFresh
from asyncgrpo.server.attention.plan import ALL_VARIANTS, ExecutionPlan, probe_plan, resolve_plan
from asyncgrpo.server.attention.rows import ContinuedRows
from asyncgrpo.server.attention.shared_prefix import GatherSharedDecode
from asyncgrpo.server.kv_cache import PagedKVCache

pytestmark = pytest.mark.engine

CPU = torch.device("cpu")
PLAIN, WINDOWED, CAPPED = (False, False), (True, False), (False, True)


def _probe(flags: PlanFlags | None = None, variants=ALL_VARIANTS, members: int = 0) -> Probe:
    return Probe(CPU, torch.float32, 4, 2, 16, frozenset(variants), flags or PlanFlags(), members)


def _kinds(plan: ExecutionPlan) -> dict[str, dict]:
    return {kind: {v: type(b) for v, b in chosen.items()} for kind, chosen in plan.backends.items()}


def test_on_the_cpu_by_default_decode_rows_gather_and_prompt_chunks_are_padded():
    plan = probe_plan(_probe())
    kinds = _kinds(plan)
    assert set(kinds) == {DECODE, FRESH, CONTINUED}  # no shared pass (auto: CUDA only), hence no rows
    assert set(kinds[DECODE].values()) == {GatherDecode}  # the Triton kernel declares CUDA only
    assert set(kinds[FRESH].values()) == {PaddedFresh} and set(kinds[CONTINUED].values()) == {PaddedContinued}
    assert (plan.shared_members, plan.row_members, plan.packed_prompts,
            plan.unsplit_rows) == (0, 0, False, None)
    assert plan.prompt_attention == "padded" and plan.graphs_capture
    assert plan.downgraded() is None
    with pytest.raises(dataclasses.FrozenInstanceError):  # nothing changes a plan once resolved
        plan.unsplit_rows = 1


def test_the_shared_pass_and_rows_where_asked_each_variant_its_own_decode_backend():
    """Backends of one layout may split the variants: the shared gather reads plain layers' groups once,
    windowed and soft-capped layers read each row's own blocks through the plain gather."""
    plan = probe_plan(_probe(PlanFlags(shared_prefix=True, continued_rows=True), members=16))
    kinds = _kinds(plan)
    assert kinds[SHARED] == {PLAIN: GatherSharedDecode, WINDOWED: GatherDecode, CAPPED: GatherDecode,
                             (True, True): GatherDecode}
    assert set(kinds[ROWS].values()) == {ContinuedRows}
    assert (plan.shared_members, plan.row_members) == (16, 16)
    assert plan.prompt_kinds == (FRESH, ROWS, CONTINUED)
    no_rows = probe_plan(_probe(PlanFlags(shared_prefix=True), members=16))  # rows auto: CUDA only
    assert ROWS not in no_rows.backends and no_rows.shared_members == 16
    assert SHARED not in probe_plan(_probe(PlanFlags(continued_rows=True))).backends  # rows need the pass


def test_packed_prompts_take_one_layout_for_every_layer_or_none():
    """Packed where insisted on (the reference computation on the CPU), for prompts from token 0 and
    continued chunks alike; a soft-capped layer refuses it, and auto then downgrades to padded."""
    plan = probe_plan(_probe(PlanFlags(packed_prompts=True), variants={PLAIN, WINDOWED}))
    assert set(_kinds(plan)[FRESH].values()) == {ReferencePackedFresh}
    assert set(_kinds(plan)[CONTINUED].values()) == {ReferencePackedContinued}
    assert plan.packed_prompts and plan.prompt_attention == "flash_varlen"
    assert plan.downgraded() is None  # insisted on: no downgrade
    with pytest.raises(ValueError, match="soft-cap"):
        probe_plan(_probe(PlanFlags(packed_prompts=True), variants={PLAIN, CAPPED}))


def test_the_self_checks_downgrade_pads_what_the_probe_packed(monkeypatch):
    """Where the probe itself took packed prompt chunks (here FlashAttention's backends made to run on the
    CPU, their check passing), `downgraded()` is the same plan with padded ones."""
    from asyncgrpo.server.attention import varlen
    from asyncgrpo.server.attention.fresh import FlashFresh

    monkeypatch.setattr(FlashFresh, "support", Support(softcap=False))
    monkeypatch.setattr(varlen, "varlen_works_on", lambda *args, **kwargs: True)
    plan = probe_plan(_probe(variants={PLAIN, WINDOWED}))
    assert plan.packed_prompts and plan.probe.flags.packed_prompts is None
    lower = plan.downgraded()
    assert not lower.packed_prompts and lower.downgraded() is None
    assert _kinds(lower)[DECODE] == _kinds(plan)[DECODE]  # only the prompt layouts change


def test_the_graph_key_comes_from_the_plan(monkeypatch):
    """Group entries are a dimension only with the shared pass; from `unsplit_rows` rows on (the Triton
    kernel's, where it serves every variant) a graph reads the whole block table."""
    plan = probe_plan(_probe())
    assert plan.graph_key(8, 4, 3, False, max_blocks=64) == (8, 4, 0, False)
    shared = probe_plan(_probe(PlanFlags(shared_prefix=True), members=16))
    assert shared.graph_key(8, 4, 3, True, max_blocks=64) == (8, 4, 3, True)
    wide = dataclasses.replace(plan, unsplit_rows=8)
    assert (wide.graph_key(4, 4, 0, False, 64) == (4, 4, 0, False)
            and wide.graph_key(8, 4, 0, False, 64)[1] == 64)
    # the Triton kernel's declaration is what keeps it off the CPU; allowed there (its check stubbed), it
    # serves every variant and the plan takes whole tables from its unsplit rows on
    monkeypatch.setattr(TritonDecode, "support", Support(graphs=True))
    monkeypatch.setattr(TritonDecode, "check", classmethod(lambda cls, probe, variant: True))
    triton = probe_plan(_probe())
    # 2 x 1 SM / 2 kv heads
    assert set(_kinds(triton)[DECODE].values()) == {TritonDecode} and triton.unsplit_rows == 1


def test_a_new_layout_is_one_file_and_one_line_of_the_probe(monkeypatch):
    """`toy_layout.py` (its segment, backend, claim and forward) and its line in KINDS: the plan lays
    single-token prompts out with it and the runner's steps compute them through it, with no change to
    the runner, the plan or the attention function; the engine samples what it samples without it."""
    monkeypatch.setattr(plan_module, "KINDS", (LINE, *plan_module.KINDS))
    model = tiny_qwen3()
    cache = PagedKVCache(2, 8, BS, 2, 16, torch.float32, CPU)
    plan = resolve_plan(model, cache, CPU)
    assert plan.prompt_kinds == (ONE_TOKEN, FRESH, CONTINUED) and "one_token: one_token" in plan.describe()
    # a step of two one-token prompts and a longer one: the toy segment, then `fresh` for the rest
    step = plan.attention(cache, np.arange(7), None, [], [1, 1, 5])
    assert [s.kind for s in step.segments] == [ONE_TOKEN, FRESH] and step.segments[0].num_tokens == 2

    work = [([t], seed) for seed, t in enumerate((5, 9, 9, 60))] + [(_prompt(3, 20), 7)]
    OneTokenBackend.forwards = 0
    toy = Harness(model, caching=True).run(work)
    assert OneTokenBackend.forwards > 0
    monkeypatch.undo()  # the probe's own lines: the same work without the toy layout
    forwards = OneTokenBackend.forwards
    _assert_same(toy, Harness(model, caching=True).run(work))
    assert OneTokenBackend.forwards == forwards
