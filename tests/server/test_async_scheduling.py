"""The engine thread with asynchronous scheduling (step N + 1 planned and launched before step N's
tokens are recorded) against the same engine stepping synchronously (CPU, float32, a tiny random
Qwen3): the same requests give the same tokens, log-probs, top lists, candidate sets and finish
reasons, with sequences that end on stop tokens (whose next-step rows are dropped) and by length,
min_tokens, greedy rows, a repetition penalty (which makes the engine record before it launches),
preemption, prefix caching (blocks that end in a pending token are registered when it is recorded,
so a conversation's next turn finds them), the fixed-shape path and aborts; no block leaks."""

from __future__ import annotations

import asyncio
import copy
import dataclasses

import pytest
import torch
from test_scheduler_prefix_caching import BS, MAX_LEN, VOCAB, tiny_qwen3

from asyncgrpo.server.attention.base import PlanFlags
from asyncgrpo.server.attention.plan import resolve_plan
from asyncgrpo.server.engine import Engine
from asyncgrpo.server.kv_cache import PagedKVCache
from asyncgrpo.server.prefix_cache import BlockPool
from asyncgrpo.server.runner import ModelRunner
from asyncgrpo.server.scheduler import Scheduler
from asyncgrpo.server.sequence import SeqParams, Sequence
from asyncgrpo.server.step_graphs import StepGraphs

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
def model():
    return tiny_qwen3()


PARAMS = SeqParams(temperature=1.0, top_k=20, top_p=0.9, min_p=0.0, seed=0, max_tokens=24, min_tokens=0,
                   # ~8% of the vocabulary: some sequences stop after a few tokens
                   stop_token_ids=frozenset(range(40, 48)), eos_token_id=None, extra_eos_ids=frozenset(),
                   logprobs=3, want_mask=True)


class _Sink:
    stream = True

    def __init__(self, num_seqs: int) -> None:
        self.remaining = num_seqs
        self.done = asyncio.get_running_loop().create_future()
        self.events = 0

    def __call__(self, events) -> None:
        self.events += len(events)
        self.remaining -= sum(ev[3] for ev in events)
        if self.remaining <= 0 and not self.done.done():
            self.done.set_result(None)


class Server:
    """An engine thread over a scheduler and model runner, driven from an asyncio loop."""

    def __init__(self, model, async_scheduling: bool, num_blocks: int = 64, fixed_shape: bool = False,
                 served: tuple[Scheduler, ModelRunner] | None = None, device: str = "cpu") -> None:
        """served: a (scheduler, runner) pair built elsewhere, instead of one over `model`. device: CUDA
        captures and replays the fixed-shape steps as graphs."""
        if served is None:
            device = torch.device(device)
            cache = PagedKVCache(2, num_blocks, BS, 2, 16, torch.float32, device)
            sched = Scheduler(BlockPool(num_blocks, True), BS, 8, 4096, MAX_LEN)
            # fixed_shape: the static path CUDA graphs replay (decode steps and steps of short chunks as rows)
            plan = resolve_plan(model, cache, device,
                                PlanFlags(shared_prefix=fixed_shape, continued_rows=fixed_shape))
            graphs = StepGraphs(model, cache, plan, 8, sched.max_blocks, device.type == "cuda", VOCAB,
                                64) if fixed_shape else None
            served = sched, ModelRunner(model, cache, plan, VOCAB, sched.block_table, graphs)
        self.sched, self.runner = served
        self.async_scheduling = async_scheduling
        self.launches_reading_pending = 0  # launches whose decode rows took a token from the device
        launch = self.runner.launch

        def spy(decode, prefill):
            self.launches_reading_pending += any(s.pending for s in decode)
            return launch(decode, prefill)

        self.runner.launch = spy
        self.num_ids = 0

    def seqs(self, requests: list[tuple[list[int], dict]]) -> list[Sequence]:
        out = []
        for prompt, overrides in requests:
            params = dataclasses.replace(PARAMS, seed=self.num_ids, **overrides)
            out.append(Sequence(self.num_ids, f"r{self.num_ids}", 0, list(prompt), params, MAX_LEN))
            self.num_ids += 1
        return out

    def run(self, waves, abort_after_events: int | None = None):
        """Each wave's requests (built from the previous waves' sequences) to the end; returns them all."""
        async def go():
            engine = Engine(self.runner, self.sched, async_scheduling=self.async_scheduling)
            engine.start(asyncio.get_running_loop())
            done = []
            for wave in waves:
                seqs = self.seqs(wave(done))
                sink = _Sink(len(seqs))
                engine.submit(seqs, sink)
                if abort_after_events is not None:
                    while sink.events < abort_after_events and not sink.done.done():
                        await asyncio.sleep(0.001)
                    await engine.abort([seqs[0].request_key])
                await asyncio.wait_for(sink.done, 120)
                done.extend(seqs)
            await asyncio.get_running_loop().run_in_executor(None, engine.stop)
            assert engine.dead is None, engine.dead
            return done, engine.stats

        seqs, stats = asyncio.run(go())
        assert not self.sched.running and not self.sched.waiting
        assert self.sched.pool.num_free == self.sched.pool.num_blocks, "every block back in the pool"
        bad = [(self.async_scheduling, s.seq_id, s.pending, s.num_tokens, s.num_known, s.finish_reason)
               for s in seqs if s.pending or s.num_tokens != s.num_known]
        assert not bad, bad
        return seqs, stats


def _prompt(seed: int, n: int, vocab: int = VOCAB) -> list[int]:
    return torch.randint(2, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _assert_same(a_seqs: list[Sequence], b_seqs: list[Sequence]) -> None:
    for a, b in zip(a_seqs, b_seqs, strict=True):
        assert a.output == b.output, a.seq_id
        assert (a.finish_reason, a.stop_reason, a.error) == (b.finish_reason, b.stop_reason, b.error)
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-4, rtol=0)
        assert a.ranks == b.ranks and a.top_ids == b.top_ids and a.masks == b.masks
        torch.testing.assert_close(torch.tensor(a.top_logprobs),
                                   torch.tensor(b.top_logprobs), atol=1e-4, rtol=0)


def _first_wave(done):
    group = _prompt(0, 40)  # a GRPO group: one prompt, several seeds
    return ([(group, {}) for _ in range(4)]
            + [(_prompt(1, 13), {"max_tokens": 1}),
               (_prompt(2, 30), {"temperature": 0.0, "top_k": 0, "top_p": 1.0, "want_mask": False})]
            + [(_prompt(3, 17), {"min_tokens": 6, "max_tokens": 9}), (_prompt(4, 5), {"max_tokens": 40})])


def _next_turns(done):
    """Each conversation of the first wave goes on: its whole history plus a new user message."""
    return [(s.prompt + s.output + _prompt(100 + s.seq_id, 7), {"max_tokens": 12}) for s in done[:6]]


@pytest.mark.parametrize("fixed_shape", [False, True], ids=["eager", "fixed-shape"])
def test_asynchronous_steps_sample_what_synchronous_steps_sample(model, fixed_shape):
    on = Server(model, async_scheduling=True, fixed_shape=fixed_shape)
    off = Server(model, async_scheduling=False, fixed_shape=fixed_shape)
    (a, a_stats), (b, b_stats) = on.run([_first_wave, _next_turns]), off.run([_first_wave, _next_turns])
    _assert_same(a, b)
    reasons = {s.finish_reason for s in a}
    assert reasons == {"stop", "length"}, "the requests end both ways"
    assert on.launches_reading_pending > 10 and off.launches_reading_pending == 0
    # blocks completed by generated tokens were registered once those were recorded: the next turns
    # hit as much of their histories as the synchronous engine's did
    assert on.sched.pool.stats.hits == off.sched.pool.stats.hits > 6 * BS
    assert a_stats.generation_tokens == b_stats.generation_tokens == sum(len(s.output) for s in a)
    assert a_stats.prompt_tokens == b_stats.prompt_tokens


def test_a_repetition_penalty_and_preemption(model):
    def wave(done):
        return [(_prompt(10 + i, 20), {"max_tokens": 40, "repetition_penalty": 1.3 if i == 2 else 1.0,
                                       "stop_token_ids": frozenset()})
                for i in range(6)]

    # 10 blocks of 16 tokens for six sequences of up to 60: the youngest are preempted and come back
    on, off = Server(model, True, num_blocks=10), Server(model, False, num_blocks=10)
    (a, a_stats), (b, b_stats) = on.run([wave]), off.run([wave])
    _assert_same(a, b)
    assert a_stats.num_preemptions > 0 and b_stats.num_preemptions > 0
    assert on.launches_reading_pending > 0


def test_an_abort_while_a_step_is_in_flight(model):
    def wave(done):
        return [(_prompt(20 + i, 12), {"max_tokens": 60, "stop_token_ids": frozenset()}) for i in range(4)]

    on, off = Server(model, True), Server(model, False)
    (a, _), (b, _) = on.run([wave], abort_after_events=12), off.run([wave])
    assert a[0].finish_reason == "abort" and len(a[0].output) < 60
    _assert_same(a[1:], b[1:])  # the others are untouched


@pytest.mark.parametrize("fixed_shape", [False, True], ids=["eager", "fixed-shape"])
def test_a_deltanet_hybrid(fixed_shape):
    """Each sequence's recurrent state advances once per recorded token, also where a stop token
    dropped a row of the next step (which advanced a state whose row is then given to a new sequence)."""
    from test_recurrent_state import sensitive_hybrid, serve

    model = sensitive_hybrid("qwen3_5_text")

    def wave(done):
        vocab = model.config.vocab_size  # stop tokens: a thirtieth of it
        return [(_prompt(30 + i, 9 + 5 * i, vocab), {"stop_token_ids": frozenset(range(2, 2 + vocab // 30))})
                for i in range(10)]

    on = Server(None, True, served=serve(copy.deepcopy(model), max_num_seqs=4, fixed=fixed_shape))
    off = Server(None, False, served=serve(copy.deepcopy(model), max_num_seqs=4, fixed=fixed_shape))
    (a, _), (b, _) = on.run([wave]), off.run([wave])
    _assert_same(a, b)
    assert {s.finish_reason for s in a} == {"stop", "length"} and on.launches_reading_pending > 0


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_request_mixes(model, seed):
    """Random mixes of the parameters that change when a sequence ends or what a step must know (stop
    tokens, lengths, min_tokens, penalties, greedy rows, top lists, masks), prompts that share blocks and
    a pool small enough to preempt: asynchronous and synchronous steps give the same results, and every
    sequence's lists agree in length."""
    rng = torch.Generator().manual_seed(seed)

    def draw(n: int) -> int:
        return int(torch.randint(n, (1,), generator=rng))

    shared = _prompt(1000 + seed, 20)
    requests = []
    for i in range(14):
        prompt = (shared if draw(2) else []) + _prompt(2000 + 50 * seed + i, 1 + draw(30))
        params = {"max_tokens": 1 + draw(60), "min_tokens": draw(6), "logprobs": draw(4) or None,
                  "want_mask": bool(draw(2)), "stop_token_ids": frozenset(range(40, 40 + draw(12)))}
        if draw(4) == 0:
            params["repetition_penalty"] = 1.2
        if draw(4) == 0:
            params.update(temperature=0.0, top_k=0, top_p=1.0, want_mask=False)
        requests.append((prompt, params))
    on, off = Server(model, True, num_blocks=10), Server(model, False, num_blocks=10)
    (a, a_stats), (b, _) = on.run([lambda done: requests]), off.run([lambda done: requests])
    _assert_same(a, b)
    assert a_stats.num_preemptions > 0
    for s in a:
        n, k = len(s.output), s.params.logprobs or 0
        assert n == len(s.logprobs) == len(s.ranks) and len(s.top_ids) == len(s.top_logprobs) == k * n
        assert len(s.masks) == (n if s.params.want_mask else 0) and 1 <= n <= s.params.max_tokens
        assert s.finish_reason == "length" or (s.output[-1] in s.params.stop_token_ids
                                               and n >= s.params.min_tokens)
