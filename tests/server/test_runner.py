"""Model runner + scheduler on CPU: the fixed-shape decode path (what CUDA graphs replay) gives the
same tokens and log-probs as the eager flat path, with sequences joining and leaving mid-way."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from asyncgrpo.server.attention.plan import resolve_plan
from asyncgrpo.server.engine import warm_up
from asyncgrpo.server.kv_cache import PagedKVCache, register_attention
from asyncgrpo.server.prefix_cache import BlockPool
from asyncgrpo.server.runner import ModelRunner
from asyncgrpo.server.scheduler import Scheduler
from asyncgrpo.server.sequence import SeqParams, Sequence
from asyncgrpo.server.step_graphs import StepGraphs

pytestmark = pytest.mark.engine

MAX_LEN = 64


def _model():
    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         max_position_embeddings=128)
    model = Qwen3ForCausalLM(copy.deepcopy(config)).eval()
    model.set_attn_implementation(register_attention())
    return model


def _engine(model, static: bool, wide: bool = False):
    """wide: every step's graph takes the whole block table (columns past its contexts hold stale blocks),
    as a plan whose decode attention never splits contexts orders."""
    cache = PagedKVCache(2, 40, 16, 2, 16, torch.float32, torch.device("cpu"))
    sched = Scheduler(BlockPool(40), 16, 8, 4096, MAX_LEN)
    plan = resolve_plan(model, cache, torch.device("cpu"))
    if wide:
        plan = dataclasses.replace(plan, unsplit_rows=1)
    graphs = StepGraphs(model, cache, plan, 8, sched.max_blocks, False, 101) if static else None
    runner = ModelRunner(model, cache, plan, 101, sched.block_table, graphs)
    warm_up(runner, sched)
    return sched, runner


def _params(seed: int, max_tokens: int) -> SeqParams:
    return SeqParams(temperature=1.0, top_k=10, top_p=0.9, min_p=0.0, seed=seed,
                     max_tokens=max_tokens, min_tokens=0,
                     stop_token_ids=frozenset(), eos_token_id=None, extra_eos_ids=frozenset(), logprobs=3,
                     want_mask=True)


def _step(sched, runner) -> None:
    """One engine step: schedule, run, record the outputs, release finished sequences."""
    plan = sched.schedule()
    scheduled = plan.sampled
    runner.step(plan.decode, plan.prefill).record(scheduled, "v")
    for s in scheduled:
        if s.finished:
            sched.remove(s)


def _run(model, static: bool, wide: bool = False) -> list[Sequence]:
    sched, runner = _engine(model, static, wide)
    seqs = [Sequence(i, f"r{i}", 0, list(range(3 + i, 10 + 2 * i)), _params(i, 12 + 3 * i), MAX_LEN)
            for i in range(5)]
    steps = 0
    pending = list(seqs)
    while any(not s.finished for s in seqs):
        if pending and steps % 3 == 0:  # one new request every third step: mixed and decode-only steps
            sched.add(pending.pop(0))
        _step(sched, runner)
        steps += 1
    assert sched.pool.num_free == sched.pool.num_blocks
    return seqs


@pytest.mark.parametrize("wide", [False, True], ids=["table-buckets", "whole-table"])
def test_static_decode_path_matches_eager_path(wide):
    model = _model()
    eager = _run(model, static=False)
    static = _run(model, static=True, wide=wide)
    for a, b in zip(eager, static):
        assert a.output == b.output and len(a.output) == a.params.max_tokens
        assert a.masks == b.masks
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5, rtol=0)


def test_rows_taken_over_by_new_sequences_sample_with_their_own_parameters():
    """A row freed by a finished sequence and re-admitted with other parameters (top_k, log-prob
    count, masks, min_tokens) samples with the new ones."""
    model = _model()
    sched, runner = _engine(model, static=True)
    first = [Sequence(i, f"a{i}", 0, [1, 2, 3 + i], _params(i, 2), MAX_LEN) for i in range(8)]
    narrow = SeqParams(temperature=1.0, top_k=2, top_p=1.0, min_p=0.0, seed=5, max_tokens=6, min_tokens=4,
                       stop_token_ids=frozenset(range(50)), eos_token_id=None, extra_eos_ids=frozenset(),
                       logprobs=1, want_mask=False)
    second = [Sequence(10 + i, f"b{i}", 0, [4, 5, 6 + i], narrow, MAX_LEN) for i in range(8)]
    for s in first + second:
        sched.add(s)
    while sched.has_work():
        _step(sched, runner)
    for s in second:
        # min_tokens keeps the stop ids (half the vocabulary) out of the first 3 tokens
        assert all(t >= 50 for t in s.output[:3]) and 4 <= len(s.output) <= 6
        assert all(r <= 2 for r in s.ranks) and len(s.top_ids) == len(s.output) and s.masks == []
    assert all(len(s.top_ids) == 3 * len(s.output) and len(s.masks) == len(s.output) for s in first)


def test_repetition_penalty_and_min_tokens_ban_against_the_models_logits():
    """The logits processors of a step (repetition penalty over prompt + output, stop ids banned before
    min_tokens) give the log-probs of the model's own logits processed by a plain loop."""
    model = _model()
    sched, runner = _engine(model, static=False)
    stops = frozenset({5, 17, 60})
    params = SeqParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=3, max_tokens=4, min_tokens=3,
                       stop_token_ids=stops, eos_token_id=None, extra_eos_ids=frozenset(), logprobs=5,
                       want_mask=False, repetition_penalty=1.7)
    seq = Sequence(0, "r0", 0, [7, 8, 9, 7, 30, 31], params, MAX_LEN)
    sched.add(seq)
    while not seq.finished:
        _step(sched, runner)
    reference = _model()  # the same weights, attending by itself
    reference.set_attn_implementation("eager")
    for i in range(len(seq.output)):
        context = seq.prompt + seq.output[:i]
        with torch.no_grad():
            logits = reference(torch.tensor([context])).logits[0, -1].double()
        for t in set(context):  # vLLM's penalty: divide a positive logit, multiply a negative one
            logits[t] = logits[t] / 1.7 if logits[t] > 0 else logits[t] * 1.7
        if i < 3:
            logits[sorted(stops)] = float("-inf")
        ref = torch.log_softmax(logits, -1)
        assert seq.output[i] not in stops or i >= 3
        torch.testing.assert_close(torch.tensor(seq.logprobs[i], dtype=torch.float64), ref[seq.output[i]],
                                   atol=1e-4, rtol=0)
        top_ids, top_lps = seq.top(i)
        assert top_ids == ref.topk(5).indices.tolist()
        torch.testing.assert_close(torch.tensor(top_lps, dtype=torch.float64),
                                   ref.topk(5).values, atol=1e-4, rtol=0)
