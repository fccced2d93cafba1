"""Scheduler + model runner with prefix caching on and chunked prefill, against the same work with
caching off and whole prompts (CPU, float32): the same seeds give the same tokens, and log-probs agree
to float tolerance, for groups that share a prompt (admitted in one step, or after the first group
ended), multi-turn prompts that extend an earlier request, preemption, chunks of any size, and a
weight change (which must drop every cached prefix)."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from asyncgrpo.server.attention.base import PlanFlags
from asyncgrpo.server.attention.plan import resolve_plan
from asyncgrpo.server.attention.rows import MAX_RUNS
from asyncgrpo.server.attention.shared_prefix import MIN_SHARED_BLOCKS, find_shared_prefixes
from asyncgrpo.server.kv_cache import PagedKVCache, register_attention
from asyncgrpo.server.prefix_cache import BlockPool
from asyncgrpo.server.runner import ModelRunner
from asyncgrpo.server.scheduler import Scheduler
from asyncgrpo.server.sequence import SeqParams, Sequence
from asyncgrpo.server.step_graphs import StepGraphs

pytestmark = pytest.mark.engine

MAX_LEN = 256
BS = 16
VOCAB = 101


def tiny_qwen3() -> Qwen3ForCausalLM:
    """A tiny random Qwen3 (seed 0) attending through the server's paged KV cache."""
    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         max_position_embeddings=512)
    model = Qwen3ForCausalLM(copy.deepcopy(config)).eval()
    model.set_attn_implementation(register_attention())
    return model


@pytest.fixture(scope="module")
def model():
    return tiny_qwen3()


class Harness:
    """An engine without its thread: schedule, run, record, release finished sequences."""

    def __init__(self, model, caching: bool, num_blocks: int = 64, max_num_seqs: int = 8, budget: int = 4096,
                 shared_prefix: bool = False, admission_interval: int = 1, continued_rows: bool = False,
                 max_prompt_rows: int = 0, varlen_prompts: bool | None = False, device: str = "cpu",
                 dtype: torch.dtype = torch.float32) -> None:
        dev = torch.device(device)  # (a GPU test runs the same harness on CUDA)
        cache = PagedKVCache(2, num_blocks, BS, 2, 16, dtype, dev)
        self.sched = Scheduler(BlockPool(num_blocks, caching), BS, max_num_seqs, budget, MAX_LEN,
                               admission_interval=admission_interval)
        # shared_prefix: decode steps take the fixed-shape path (what CUDA graphs replay) and read the
        # blocks that groups share through the group's first table (the Triton kernels' arithmetic)
        # continued_rows (with shared_prefix): short chunks after cached tokens run as rows of the decode
        # attention, as on a GPU with the Triton kernels; with max_prompt_rows, steps whose chunks add
        # at most that many rows take the fixed-shape path (`step_rows.prompt_rows`) with all chunks as rows
        # varlen_prompts: prompt chunks packed as for FlashAttention (on the CPU through its reference
        # computation; None: the probe's choice)
        flags = PlanFlags(shared_prefix=shared_prefix, continued_rows=continued_rows,
                          packed_prompts=varlen_prompts)
        plan = resolve_plan(model, cache, dev, flags)
        graphs = StepGraphs(model, cache, plan, max_num_seqs, self.sched.max_blocks, False, VOCAB,
                            max_prompt_rows) if shared_prefix else None
        self.runner = ModelRunner(model, cache, plan, VOCAB, self.sched.block_table, graphs)
        self.num_ids = 0
        self.num_preempted = 0
        self.plans = []  # (decode, prefill chunks as (seq_id, start, end)) of every step
        self.shared_entries = []  # group entries sharing blocks among the decode sequences of every step

    def add(self, prompts_and_seeds: list[tuple[list[int], int]], max_tokens: int = 12) -> list[Sequence]:
        seqs = []
        for prompt, seed in prompts_and_seeds:
            params = SeqParams(temperature=1.0, top_k=20, top_p=1.0, min_p=0.0,
                               seed=seed, max_tokens=max_tokens,
                               min_tokens=0, stop_token_ids=frozenset(), eos_token_id=None,
                               extra_eos_ids=frozenset(), logprobs=4, want_mask=False)
            seqs.append(Sequence(self.num_ids, f"r{self.num_ids}", 0, list(prompt), params, MAX_LEN))
            self.num_ids += 1
            self.sched.add(seqs[-1])
        return seqs

    def run(self, prompts_and_seeds: list[tuple[list[int], int]], max_tokens: int = 12) -> list[Sequence]:
        seqs = self.add(prompts_and_seeds, max_tokens)
        while any(not s.finished for s in seqs):
            self.step()
        assert self.sched.pool.num_free == self.sched.pool.num_blocks
        return seqs

    def step(self) -> None:
        """One engine step: schedule, run, record, release finished sequences."""
        plan = self.sched.schedule()
        self.num_preempted += len(plan.preempted)
        self.plans.append(([s.seq_id for s in plan.decode],
                           [(s.seq_id, s.prefill_start, s.prefill_end) for s in plan.prefill]))
        if plan.decode and self.runner.plan.shared_members:
            rows = [s.row for s in plan.decode]
            num = np.array([s.num_tokens for s in plan.decode])
            found = find_shared_prefixes(self.sched.block_table[rows, : -(-num.max() // BS)], num, BS,
                                         self.runner.plan.shared_members, self.sched.null_block)
            self.shared_entries.append(0 if found is None else found.num_groups)
        scheduled = plan.sampled
        self.runner.step(plan.decode, plan.prefill).record(scheduled, "v")
        for s in scheduled:
            if s.finished:
                self.sched.remove(s)


def _assert_same(cached: list[Sequence], plain: list[Sequence]) -> None:
    for a, b in zip(cached, plain, strict=True):
        assert a.output == b.output
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-4, rtol=0)
        assert a.top_ids == b.top_ids
        torch.testing.assert_close(torch.tensor(a.top_logprobs),
                                   torch.tensor(b.top_logprobs), atol=1e-4, rtol=0)


def _prompt(seed: int, n: int) -> list[int]:
    return torch.randint(2, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("rows,varlen", [(False, False), (True, False), (False, True), (True, True)],
                         ids=["padded", "rows", "packed", "rows+packed"])
def test_groups_and_multi_turn_prompts_match_an_uncached_server(model, rows, varlen):
    on = Harness(model, caching=True, shared_prefix=rows, continued_rows=rows, varlen_prompts=varlen)
    off = Harness(model, caching=False)
    prompt = _prompt(0, 45)  # 2 full blocks + 13 tokens
    waves = [
        [(prompt, seed) for seed in range(4)],  # one group admitted in one step: shares as it is computed
        [(prompt, seed) for seed in range(10, 13)],  # the same prompt after the group ended: cached blocks
    ]
    results = []
    for wave in waves:
        results.append((on.run(wave), off.run(wave)))
        _assert_same(*results[-1])
    stats = on.sched.pool.stats
    assert stats.hits == 3 * 32 + 3 * 32 and stats.queries == 7 * 45
    assert off.sched.pool.stats.hits == 0
    # the next turn of a conversation: the whole previous request (prompt + output) plus new tokens
    first = results[0][0][0]
    turn2 = first.prompt + first.output + _prompt(1, 9)
    hits_before = stats.hits
    _assert_same(on.run([(turn2, 5)]), off.run([(turn2, 5)]))
    assert stats.hits - hits_before == (len(first.prompt) + len(first.output) - 1) // BS * BS
    turn3 = turn2 + _prompt(2, 20)  # an extension of an extension, two seeds
    _assert_same(on.run([(turn3, 6), (turn3, 7)]), off.run([(turn3, 6), (turn3, 7)]))


def test_groups_reading_their_shared_prompt_once_match_an_uncached_server(model):
    """Decode attention that reads a group's shared prompt blocks once for all its members (through the
    first member's table) gives what plain attention gives: groups, groups behind a common system
    prompt, a lone request, a next turn, members joining while others decode."""
    shared = Harness(model, caching=True, shared_prefix=True, num_blocks=160, max_num_seqs=12)
    off = Harness(model, caching=False, num_blocks=160, max_num_seqs=12)
    system = _prompt(20, 24)
    long_prompt = _prompt(21, (MIN_SHARED_BLOCKS + 1) * BS + 5)
    work = [(long_prompt, seed) for seed in range(3)]
    work += [(system + _prompt(22 + g, 50), 10 * g + seed) for g in range(2) for seed in range(4)]
    work += [(_prompt(30, 90), 40)]
    _assert_same(shared.run(work, max_tokens=24), off.run(work, max_tokens=24))
    assert max(shared.shared_entries) >= 3  # the steps had groups to read once
    first = shared.run([(long_prompt, 50)], max_tokens=3)[0]
    turn2 = [(first.prompt + first.output + _prompt(31, 7), seed) for seed in range(3)]
    _assert_same(shared.run(turn2 + work[:2], max_tokens=20), off.run(turn2 + work[:2], max_tokens=20))


def test_admitting_every_few_steps_batches_arrivals_and_changes_no_output(model):
    """Requests arriving one per step while others decode: with an admission interval of 4 they enter
    in groups (a quarter of the steps carry prompt tokens), wait at most 3 steps, and every sequence
    samples what it samples when admitted at once (seeded per position, not per batch)."""
    work = [(_prompt(40 + i, 20 + i), i) for i in range(12)]
    runs = {}
    for interval in (1, 4):
        h = Harness(model, caching=True, max_num_seqs=12, admission_interval=interval)
        seqs, arrived = [], {}
        while len(seqs) < len(work) or any(not s.finished for s in seqs):
            if len(seqs) < len(work):
                seqs += h.add([work[len(seqs)]], max_tokens=10)
                arrived[seqs[-1].seq_id] = len(h.plans)
            h.step()
        first_chunk = {seq_id: i for i, (_, prefill) in reversed(list(enumerate(h.plans)))
                       for seq_id, _, _ in prefill}
        runs[interval] = seqs, h.plans, max(first_chunk[i] - arrived[i] for i in arrived)
    _assert_same(runs[4][0], runs[1][0])
    steps_with_prompts = {n: sum(1 for _, prefill in plans if prefill) for n, (_, plans, _) in runs.items()}
    assert steps_with_prompts[1] == 12 and steps_with_prompts[4] <= 12 // 4 + 1
    assert runs[1][2] == 0 and runs[4][2] == 3  # steps a request waited for its first chunk


def test_a_prompt_of_whole_blocks_still_computes_its_last_token(model):
    on, off = Harness(model, caching=True), Harness(model, caching=False)
    prompt = _prompt(3, 32)
    on.run([(prompt, 0)])
    _assert_same(on.run([(prompt, 1)]), off.run([(prompt, 1)]))
    assert on.sched.pool.stats.hits == BS  # one block: the second holds the token that must be computed


def test_preemption_under_a_small_pool_matches_an_uncached_server(model):
    on, off = Harness(model, caching=True, num_blocks=9), Harness(model, caching=False, num_blocks=9)
    prompt = _prompt(4, 40)
    work = [(prompt, seed) for seed in range(4)] + [(_prompt(5, 30), 9)]
    _assert_same(on.run(work, max_tokens=30), off.run(work, max_tokens=30))
    assert on.num_preempted > 0 and on.sched.pool.stats.hits > 0


def test_a_weight_change_drops_every_cached_prefix(model):
    model = copy.deepcopy(model)
    on = Harness(model, caching=True)
    prompt = _prompt(6, 50)
    on.run([(prompt, 0)])
    with torch.no_grad():
        model.model.layers[0].mlp.up_proj.weight.mul_(1.5)
    on.sched.invalidate_prefix_cache()
    hits = on.sched.pool.stats.hits
    after = on.run([(prompt, 1)])
    assert on.sched.pool.stats.hits == hits  # nothing computed by the old weights is found
    _assert_same(after, Harness(model, caching=False).run([(prompt, 1)]))


def test_blocks_of_a_sequence_that_outlived_a_weight_change_are_never_cached(model):
    on = Harness(model, caching=True)
    prompt = _prompt(7, 20)
    seq = on.run([(prompt, 0)], max_tokens=1)[0]
    params = seq.params
    # a sequence admitted under the old weights keeps decoding after the update (pause keep without
    # clear_cache): the blocks it fills afterwards mix both versions and must not be registered
    old = Sequence(100, "old", 0, prompt, SeqParams(**{**params.__dict__, "max_tokens": 40}), MAX_LEN)
    on.sched.add(old)
    plan = on.sched.schedule()
    on.runner.step(plan.decode, plan.prefill).record(plan.sampled, "v")
    on.sched.invalidate_prefix_cache()
    while not old.finished:
        plan = on.sched.schedule()
        on.runner.step(plan.decode, plan.prefill).record(plan.sampled, "v")
    on.sched.remove(old)
    assert on.sched.pool.num_cached == 0


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["padded", "rows", "packed"])
@pytest.mark.parametrize("budget", [7, 16, 40])
def test_chunked_prefill_matches_whole_prompts_and_never_stalls_decodes(model, budget, layout):
    long_prompt, short = _prompt(8, 120), _prompt(9, 10)
    # a short request decodes while a long prompt, a second sample of it and an extension of it prefill
    work = [(short, 1), (long_prompt, 2), (long_prompt, 3), (short + long_prompt, 4)]
    rows = layout == "rows"
    chunked = Harness(model, caching=True, budget=budget, shared_prefix=rows, continued_rows=rows,
                      varlen_prompts=layout == "packed")
    _assert_same(chunked.run(work, max_tokens=20), Harness(model, caching=False).run(work, max_tokens=20))
    chunks = [c for _, prefill in chunked.plans for c in prefill]
    assert all(end - start <= budget for _, start, end in chunks)
    assert sum(1 for seq_id, _, _ in chunks if seq_id == 1) > 1  # the long prompt took several steps
    # the short request (id 0) got one token in every step from its first to its last, while the
    # long prompts were prefilled in the same steps
    decoding = [i for i, (decode, _) in enumerate(chunked.plans) if 0 in decode]
    assert decoding == list(range(decoding[0], decoding[0] + 19))
    assert sum(1 for i in decoding if chunked.plans[i][1]) >= min(len(decoding), 120 // budget)


def test_short_chunks_as_decode_rows_beside_a_long_padded_one_match_an_uncached_server(model):
    """One step with both layouts of the chunks after cached tokens: a group's members computing their
    last blocks as rows of the decode attention, and a conversation's long next turn padded."""
    rows = Harness(model, caching=True, shared_prefix=True, continued_rows=True,
                   num_blocks=160, max_num_seqs=12)
    off = Harness(model, caching=False, num_blocks=160, max_num_seqs=12)
    first = rows.run([(_prompt(40, 5 * BS + 3), 1)], max_tokens=12)[0]
    turn2 = first.prompt + first.output + _prompt(41, 100)
    group = _prompt(42, 6 * BS + 4)
    work = [(group, seed) for seed in range(3)] + [(turn2, 7)]
    _assert_same(rows.run(work, max_tokens=16), off.run(work, max_tokens=16))
    limit = MAX_RUNS * rows.runner.plan.row_members
    continued = [[end - start for _, start, end in prefill if start > 0] for _, prefill in rows.plans]
    assert any(min(c) <= limit < max(c) for c in continued if c)


def test_steps_with_prompt_chunks_as_graph_rows_match_an_uncached_server(model):
    """Steps that carry prompt chunks through the fixed-shape path (what CUDA graphs replay), every chunk
    token a row of the decode attention beside the decoding sequences: fresh prompts, a group's members
    after its cached blocks, next turns of conversations, chunks cut by the token budget; steps with more
    prompt rows than the graphs hold run eagerly. Same tokens and log-probs as an uncached server."""
    rows = Harness(model, caching=True, shared_prefix=True, continued_rows=True,
                   num_blocks=200, max_num_seqs=12, budget=48, max_prompt_rows=46)
    off = Harness(model, caching=False, num_blocks=200, max_num_seqs=12)
    kinds = []  # per fixed-shape step with prompt chunks: whether its rows had shared-prefix groups
    run = rows.runner.graphs.run

    def counting_run(inputs, pending=None):
        if inputs.sample_rows is not None:
            kinds.append(inputs.shared is not None)
        return run(inputs, pending)

    rows.runner.graphs.run = counting_run
    first = rows.run([(_prompt(50, 3 * BS + 5), 1), (_prompt(51, 30), 2)], max_tokens=10)
    off.run([(s.prompt, s.params.seed) for s in first], max_tokens=10)
    group = _prompt(52, 4 * BS + 9)
    work = [(group, seed) for seed in range(5)]
    work += [(s.prompt + s.output + _prompt(53 + i, 6 + 11 * i), 20 + i) for i, s in enumerate(first)]
    work += [(_prompt(60, 100), 30)]  # a long prompt: chunks cut at the budget, eager steps
    _assert_same(rows.run(work, max_tokens=14), off.run(work, max_tokens=14))
    prompt_steps = sum(1 for _, prefill in rows.plans if prefill)
    assert len(kinds) >= 4 and prompt_steps - len(kinds) >= 2  # both paths ran
    assert sum(kinds) >= 2  # runs of a chunk's rows read its cached blocks once, beside the decode groups


def test_a_step_whose_rows_would_read_too_much_runs_eagerly(model, monkeypatch):
    from asyncgrpo.server.attention import rows as rows_module
    from asyncgrpo.server.attention.rows import row_step_reads

    # runs of 16 rows each read up to their chunk's end: 2 runs x 40 + 1 run x 110 (+ 1 x 1 of a decode)
    assert row_step_reads(np.array([20, 10]), np.array([20, 100]), 16) == 2 * 40 + 110
    h = Harness(model, caching=True, shared_prefix=True, continued_rows=True, max_prompt_rows=64)
    seen = []
    run = h.runner.graphs.run
    h.runner.graphs.run = lambda inputs, pending=None: (seen.append(inputs.sample_rows is not None)
                                                        or run(inputs, pending))
    monkeypatch.setattr(rows_module, "ROW_STEP_READS", 30)
    h.run([(_prompt(70, 20), 0)], max_tokens=3)  # 2 runs x 20 > 30: the prompt's step is eager
    monkeypatch.setattr(rows_module, "ROW_STEP_READS", 40)
    h.run([(_prompt(71, 20), 0)], max_tokens=3)
    assert seen == [False, False, True, False, False]
