"""The embedded server on Gated DeltaNet hybrids (Qwen3.5, Qwen3.5-MoE, Qwen3-Next): each running
sequence carries its DeltaNet layers' recurrent state (conv window + delta-rule state) from step to
step, so the log-probs it returns equal the model's own forward over prompt + output, with
sequences of different lengths batched, joining mid-way, prefilled beside decodes and preempted."""

from __future__ import annotations

import copy
import os
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

# the tiny hybrids of tests/packing/test_tree_deltanet.py
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "packing"))
from test_tree_deltanet import HYBRIDS, tiny_hybrid

from asyncgrpo.modeling.deltanet.layer import deltanet_layers
from asyncgrpo.server.attention.plan import GraphKey, resolve_plan
from asyncgrpo.server.engine import warm_up
from asyncgrpo.server.kv_cache import PagedKVCache
from asyncgrpo.server.loading import prepare_model
from asyncgrpo.server.prefix_cache import BlockPool
from asyncgrpo.server.recurrent_state import RecurrentState
from asyncgrpo.server.runner import ModelRunner
from asyncgrpo.server.scheduler import Scheduler
from asyncgrpo.server.sequence import SeqParams, Sequence
from asyncgrpo.server.step_graphs import StepGraphs
from asyncgrpo.server.weights import WeightLoader

pytestmark = pytest.mark.engine

MAX_LEN = 256
CPU = torch.device("cpu")


def sensitive_hybrid(model_type: str):
    """A tiny random hybrid whose DeltaNet layers weigh on the output: slow decay (a random model's
    A up to 16 forgets the state within a few tokens) and a larger output projection, so a state
    not carried between steps moves the log-probs far beyond the tolerance."""
    model = tiny_hybrid(model_type)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for layer in deltanet_layers(model):
            layer.A_log.copy_(torch.empty_like(layer.A_log).uniform_(-4.0, -1.0, generator=gen))
            layer.out_proj.weight.mul_(4.0)
    return model


def serve(model, num_blocks: int = 64, max_num_seqs: int = 8, max_num_batched_tokens: int = 4096,
          fixed: bool = False):
    """(scheduler, runner) over `model` (prepared for serving in place), as the server builds them;
    fixed: decode steps take the fixed-shape path CUDA graphs replay (run eagerly here)."""
    prepare_model(model, CPU)
    text = model.config.get_text_config()
    cache = PagedKVCache(text.num_hidden_layers, num_blocks, 16, text.num_key_value_heads, text.head_dim,
                         torch.float32, CPU)
    # no prefix caching: the server leaves models with recurrent layers uncached
    sched = Scheduler(BlockPool(num_blocks, enable_caching=False), 16, max_num_seqs,
                      max_num_batched_tokens, MAX_LEN)
    recurrent = RecurrentState.for_model(model, max_num_seqs, CPU)
    assert recurrent is not None
    plan = resolve_plan(model, cache, CPU)
    graphs = StepGraphs(model, cache, plan, max_num_seqs, sched.max_blocks, False, text.vocab_size,
                        recurrent=recurrent) if fixed else None
    runner = ModelRunner(model, cache, plan, text.vocab_size, sched.block_table, graphs, recurrent=recurrent)
    warm_up(runner, sched)
    return sched, runner


def params(seed: int, max_tokens: int, top_k: int = 0) -> SeqParams:
    return SeqParams(temperature=1.0, top_k=top_k, top_p=1.0, min_p=0.0, seed=seed, max_tokens=max_tokens,
                     min_tokens=0, stop_token_ids=frozenset(), eos_token_id=None, extra_eos_ids=frozenset(),
                     logprobs=3, want_mask=False)


def run(sched, runner, seqs: list[Sequence], join_every: int) -> int:
    """Engine steps until every sequence finished, a new one joining every `join_every` steps.
    Returns the number of preemptions."""
    pending, steps, preempted = list(seqs), 0, 0
    while any(not s.finished for s in seqs):
        if pending and steps % join_every == 0:
            sched.add(pending.pop(0))
        plan = sched.schedule()
        preempted += len(plan.preempted)
        runner.step(plan.decode, plan.prefill).record(plan.sampled, "v")
        for s in plan.sampled:
            if s.finished:
                sched.remove(s)
        steps += 1
    return preempted


def check_against_forward(reference, seq: Sequence, top_k: int = 0) -> None:
    """Every returned log-prob (sampled and top-3) equals the model's forward over prompt + output
    (log-softmax over the vocabulary, or over the top-k candidates)."""
    ids = torch.tensor([seq.prompt + seq.output])
    with torch.no_grad():
        logits = reference(input_ids=ids, use_cache=False).logits[0, len(seq.prompt) - 1 : -1].float()
    if top_k:
        kth = logits.topk(top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    logprobs = torch.log_softmax(logits, -1)
    out = torch.tensor(seq.output)
    torch.testing.assert_close(torch.tensor(seq.logprobs),
                               logprobs.gather(1, out[:, None])[:, 0], atol=1e-4, rtol=0)
    top = logprobs.topk(3, dim=-1)
    top_ids = [seq.top(i)[0] for i in range(len(seq.output))]
    top_logprobs = torch.tensor([seq.top(i)[1] for i in range(len(seq.output))])
    assert top_ids == top.indices.tolist()
    torch.testing.assert_close(top_logprobs, top.values, atol=1e-4, rtol=0)


@pytest.mark.slow
@pytest.mark.parametrize("fixed", [False, True], ids=["eager", "fixed-shape decode"])
@pytest.mark.parametrize("model_type", sorted(HYBRIDS))
def test_server_logprobs_equal_the_model_forward_with_sequences_joining_mid_way(model_type, fixed):
    model = sensitive_hybrid(model_type)
    reference = copy.deepcopy(model)
    sched, runner = serve(model, fixed=fixed)
    # prompts shorter than the conv window (1, 2 tokens) and longer than a 64-token chunk; many
    # decode steps (9 + 58 tokens cross a chunk boundary of the reference's chunked forward)
    lengths = [(9, 58), (1, 12), (70, 6), (2, 30), (33, 5)]
    seqs = [Sequence(i, f"r{i}", 0, [(7 * i + 3 * j) % 96 for j in range(p)],
                     params(i, n, top_k=20 * (i % 2)), MAX_LEN) for i, (p, n) in enumerate(lengths)]
    run(sched, runner, seqs, join_every=3)
    for s in seqs:
        assert len(s.output) == s.params.max_tokens
        check_against_forward(reference, s, s.params.top_k)
    assert sched.pool.num_free == sched.pool.num_blocks


@pytest.mark.parametrize("model_type", ["qwen3_5_text", "qwen3_next"])
def test_chunked_prefill_continues_each_prompt_from_its_recurrent_state(model_type):
    """A step budget of 16 tokens: long prompts are prefilled in chunks over several steps, beside
    running decodes; each chunk after the first starts from the conv window and delta-rule state the
    previous chunk left, so the log-probs equal an unchunked forward's."""
    model = sensitive_hybrid(model_type)
    reference = copy.deepcopy(model)
    sched, runner = serve(model, max_num_batched_tokens=16)
    lengths = [(5, 20), (70, 8), (40, 6), (17, 4)]
    seqs = [Sequence(i, f"c{i}", 0, [(13 * i + 5 * j) % 96 for j in range(p)], params(i, n), MAX_LEN)
            for i, (p, n) in enumerate(lengths)]
    chunks = []
    pending, steps = list(seqs), 0
    while any(not s.finished for s in seqs):
        if pending and steps % 2 == 0:
            sched.add(pending.pop(0))
        plan = sched.schedule()
        chunks += [(s.prefill_start, s.prefill_end) for s in plan.prefill]
        runner.step(plan.decode, plan.prefill).record(plan.sampled, "v")
        for s in plan.sampled:
            if s.finished:
                sched.remove(s)
        steps += 1
    assert any(start > 0 for start, _ in chunks), "no prompt was chunked: the test would not test chunking"
    for s in seqs:
        check_against_forward(reference, s)


@pytest.mark.parametrize("fixed", [False, True], ids=["eager", "fixed-shape decode"])
def test_preempted_sequences_rebuild_their_recurrent_state(fixed):
    """A KV pool too small for every sequence: the youngest are preempted and re-prefill prompt +
    output later; their state starts over from that prefill, so the log-probs stay exact."""
    model = sensitive_hybrid("qwen3_5_text")
    reference = copy.deepcopy(model)
    sched, runner = serve(model, num_blocks=6, max_num_seqs=4, fixed=fixed)
    seqs = [Sequence(i, f"p{i}", 0, [(5 * i + j) % 96 for j in range(10 + i)], params(i, 30), MAX_LEN)
            for i in range(4)]
    assert run(sched, runner, seqs, join_every=1) > 0
    for s in seqs:
        check_against_forward(reference, s)


def test_weights_pushed_into_the_server_land_in_the_deltanet_layers():
    """After every parameter of another model is loaded by name (what a weight sync does), the
    server's log-probs are that model's: the DeltaNet layers read the pushed conv, decay, gate and
    projection weights."""
    model = sensitive_hybrid("qwen3_5_text")
    pushed = tiny_hybrid("qwen3_5_text", seed=7)
    sched, runner = serve(model)
    names = WeightLoader(model).names()
    assert (any(".linear_attn.A_log" in n for n in names)
            and any(".linear_attn.conv1d.weight" in n for n in names))
    WeightLoader(model).load_all(pushed.named_parameters())
    seqs = [Sequence(i, f"w{i}", 0, [(11 * i + j) % 96 for j in range(4 + 5 * i)], params(i, 12), MAX_LEN)
            for i in range(3)]
    run(sched, runner, seqs, join_every=2)
    for s in seqs:
        check_against_forward(pushed, s)


def test_a_graphs_warm_up_leaves_the_rows_deltanet_state_alone():
    """Before capturing a decode step, its graph runs it once (first-use set-up) and then replays it:
    the warm-up must not advance the rows' DeltaNet state (the replay would advance it twice), so it
    runs on the scratch slot. Checked on the CPU by running the warm-up alone and comparing states."""
    model = sensitive_hybrid("qwen3_5_text")
    sched, runner = serve(model, fixed=True)
    seqs = [Sequence(i, f"w{i}", 0, [(3 * i + j) % 96 for j in range(6 + i)], params(i, 4), MAX_LEN)
            for i in range(3)]
    for s in seqs:
        sched.add(s)
    plan = sched.schedule()  # the prompts: their states now hold something
    runner.step(plan.decode, plan.prefill).record(plan.sampled, "v")
    plan = sched.schedule()
    assert plan.decode and not plan.prefill
    graphs, state = runner.graphs, runner.recurrent
    before = {i: (c.clone(), d.clone()) for (i, c), d in zip(state.conv.items(), state.delta.values())}
    nums = [s.num_tokens for s in plan.decode]
    rows = [s.row for s in plan.decode]
    from asyncgrpo.server.step_rows import decode_inputs

    dec = decode_inputs(np.array([s.last_token() for s in plan.decode]), np.array(nums), np.array(rows),
                        sched.block_table, 16)
    graphs.run(dec)  # writes the static inputs and runs the step (the state of `rows` advances) ...
    advanced = {i: (c.clone(), d.clone()) for (i, c), d in zip(state.conv.items(), state.delta.values())}
    for i, (c, d) in before.items():  # ... restore, then the warm-up alone
        state.conv[i].copy_(c), state.delta[i].copy_(d)
    bp = len(rows)
    key = GraphKey(bp, 1, 0, False)
    graphs._warm_up(("forward", *key), lambda: graphs._forward(key))
    for i, (c, d) in before.items():
        assert torch.equal(state.conv[i][rows], c[rows]) and torch.equal(state.delta[i][rows], d[rows])
        assert not torch.equal(advanced[i][1][rows], d[rows])  # a step does advance them
    assert graphs._state_rows[:bp].tolist() == rows  # the rows are back for the replay
