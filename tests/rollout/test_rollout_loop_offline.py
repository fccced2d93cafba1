"""AsyncRolloutLoop without a server: reward metrics, group samples, and the loop run in-process.

The in-process runs replace only `generate_one` (the server-facing hook); everything else is the
real loop: prompt stream, admission, scoring, advantages, samples, markers, metrics.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import queue
import threading
import time

import numpy as np
import pytest

from asyncgrpo import metrics as M
from asyncgrpo.config import AsyncGRPOConfig
from asyncgrpo.rollout.channel import GroupFinished, QueuedSample, RolloutChannel, RolloutIdle
from asyncgrpo.rollout.loop import AsyncRolloutLoop
from asyncgrpo.rollout.scoring import group_samples, reward_records
from asyncgrpo.types import Rollout, RolloutGroup, TrainingSequence, TurnRecord


def _by_name(records):
    out: dict[str, list] = {}
    for rec in records:
        out.setdefault(rec.name, []).append(rec)
    return out


def test_reward_records_of_a_kept_group_against_a_hand_computation():
    rewards = np.array([1.0, np.nan, 3.0, 2.0])
    per_source = {"acc": np.array([1.0, np.nan, 1.0, 0.0]), "fmt": np.array([0.0, np.nan, 2.0, 2.0])}
    records = _by_name(reward_records(rewards, per_source, [1, 1, 2, 0], dropped=False))
    assert [r.value for r in records["reward"]] == [1.0, 3.0, 2.0]
    assert [r.value for r in records["reward_kept"]] == [1.0, 3.0, 2.0]
    assert "reward_dropped" not in records
    assert [r.value for r in records["frac_reward_zero_std"]] == [0.0]
    (std,) = records["reward_group_std"]
    assert std.value == pytest.approx(np.std([1.0, 3.0, 2.0])) and std.weight == 4
    # per-source means are weighted by each rollout's trained samples; a rollout without samples is out
    acc = records["rewards/acc/mean"]
    assert [(r.value, r.weight) for r in acc] == [(1.0, 1), (1.0, 2)]
    (fmt_std,) = records["rewards/fmt/group_std"]
    assert fmt_std.value == pytest.approx(np.std([0.0, 2.0, 2.0]))


def test_a_source_that_applies_to_none_of_a_kept_group_records_no_std():
    # e.g. accuracy_reward (None: no gold answer) on a group of another environment's task
    per_source = {"acc": np.array([np.nan, np.nan]), "env": np.array([1.0, 0.0])}
    records = _by_name(reward_records(np.array([1.0, 0.0]), per_source, [1, 1], dropped=False))
    assert "rewards/acc/group_std" not in records and "rewards/acc/mean" not in records
    assert [r.value for r in records["rewards/env/group_std"]] == [0.5]


def test_reward_records_of_dropped_groups():
    records = _by_name(reward_records(np.array([1.0, 1.0]),
                                      {"acc": np.array([1.0, 1.0])}, [1, 1], dropped=True))
    assert [r.value for r in records["reward_dropped"]] == [1.0, 1.0]
    assert [r.value for r in records["frac_reward_zero_std"]] == [1.0]
    assert "reward_kept" not in records and "reward_group_std" not in records
    # a group nobody could score counts as zero-std but has no reward to report
    unscored = _by_name(reward_records(np.array([np.nan, np.nan]), {}, [1, 1], dropped=True))
    assert set(unscored) == {"frac_reward_zero_std"}


def test_group_samples_carry_their_rollout_advantage_and_sampler_data():
    seq = TrainingSequence(
        token_ids=[1, 2, 3],
        trained_mask=[0, 1, 1],
        sampler_logprobs=[0.0, -0.5, -0.25],
        sampler_topk=[None, {2: -0.5, 9: -1.0}, {3: -0.25}],
    )
    group = RolloutGroup(
        prompts=[[], []], reward_kwargs={}, completions=[[], []], completions_ids=[[2, 3], []],
        completions_sequences=[[seq, seq], []], tool_call_counts=[0, 0], tool_failure_counts=[0, 0],
        model_version=3, group_id=7, row_index=1, env_rewards=[None, None], rollout_rewards=[None, None],
    )
    samples = group_samples(group, ["r0", "r1"], np.array([0.5, -0.5]))
    assert len(samples) == 2
    for s in samples:
        assert (s.advantage, s.group_id, s.model_version, s.rollout_id) == (0.5, 7, 3, "r0")
        assert s.trained_mask.tolist() == [False, True, True]
        assert (s.sampler_topk_ids[1].tolist() == [2, 9]
                and s.sampler_topk_logprobs[2, 0] == pytest.approx(-0.25))


# -- the loop in-process, without a server -------------------------------------------------------


class ScriptedLoop(AsyncRolloutLoop):
    """`generate_one` without a server: completion length = row's `n` + rollout order in the group."""

    async def setup(self):
        self.calls = self.running = self.finished = self.peak_before_first_group = 0

    async def generate_one(self, prompt, tools, group_id=0):
        self.running += 1
        if self.finished < self.config.num_generations:
            self.peak_before_first_group = max(self.peak_before_first_group, self.running)
        await asyncio.sleep(0.005)
        self.running -= 1
        self.finished += 1
        self.calls += 1
        n = 1 + self.calls % 3
        out = [5] * n + [0]
        return Rollout(
            completion=[{"role": "assistant", "content": "x" * n}],
            completion_ids=out,
            turns=[TurnRecord(prompt_ids=[1, 2], output_ids=out, output_log_probs=[-0.1] * len(out))],
        )


def length_reward(completion_ids, **kwargs):
    return [float(len(ids)) for ids in completion_ids]


def index_reward(completions, **kwargs):
    return [float(i) for i in range(len(completions))]


class InProcess:
    """Runs a loop on its own event loop in a thread; the test plays the trainer."""

    def __init__(self, loop_cls, reward_funcs, *, allowance=1_000_000, rows=6, **config):
        self.channel = RolloutChannel.create(mp.get_context("spawn"), initial_allowance=allowance)
        cfg = AsyncGRPOConfig(output_dir="/tmp/asyncgrpo-test-loop", num_generations=3,
                              report_to="none", **config)
        dataset = [{"prompt": [{"role": "user", "content": f"q{i}"}], "n": i} for i in range(rows)]
        self.loop = loop_cls(
            config=cfg, model_name="scripted", dataset=dataset, reward_funcs=reward_funcs,
            processing_class=None, eos_token_ids=[0], channel=self.channel,
        )
        self.error: BaseException | None = None
        self.idle: list[RolloutIdle] = []  # RolloutIdle items seen by `take`, in order
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        try:
            asyncio.run(self.loop.run())
        except BaseException as exc:  # noqa: BLE001 -- checked by the test
            self.error = exc

    def take(self, num_markers, *, consume=True, timeout_s=20.0):
        """Samples and markers until `num_markers` markers arrived; RolloutIdle items go to `self.idle`."""
        items, markers = [], 0
        deadline = time.monotonic() + timeout_s
        while markers < num_markers:
            assert self.error is None, self.error
            assert time.monotonic() < deadline, f"{markers}/{num_markers} markers"
            try:
                item = self.channel.samples.get(timeout=0.1)
            except queue.Empty:
                continue
            if isinstance(item, RolloutIdle):
                self.idle.append(item)
                continue
            items.append(item)
            markers += isinstance(item, GroupFinished)
            if consume and isinstance(item, QueuedSample):
                with self.channel.consumed_tokens.get_lock():
                    self.channel.consumed_tokens.value += len(item.sample.token_ids)
        return items

    def next_item(self, timeout_s=10.0):
        """The next item of the sample queue (None if nothing came within `timeout_s`)."""
        try:
            return self.channel.samples.get(timeout=timeout_s)
        except queue.Empty:
            return None

    def consume(self, num_tokens):
        with self.channel.consumed_tokens.get_lock():
            self.channel.consumed_tokens.value += num_tokens

    def stop(self):
        self.channel.stop_event.set()
        self.thread.join(15)
        assert not self.thread.is_alive()

    def records(self):
        out = []
        while True:
            try:
                out.append(self.channel.metrics.get(timeout=0.2))
            except queue.Empty:
                return out


def test_in_process_loop_queues_samples_then_markers_and_stops():
    run = InProcess(ScriptedLoop, [index_reward])
    items = run.take(6)
    run.stop()
    assert run.error is None
    assert run.loop.peak_before_first_group == 3  # one group at a time until the first one finished
    seen: dict[int, int] = {}
    for item in items:
        if isinstance(item, QueuedSample):
            seen[item.position] = seen.get(item.position, 0) + 1
        else:
            assert item.num_samples == seen.get(item.position, 0) == 3
    names = {r[0] for r in run.records()}
    reward_names = {r.name for item in items if isinstance(item, GroupFinished) for r in item.records}
    # a group's records ride its marker
    assert M.REWARD in reward_names and M.FRAC_REWARD_ZERO_STD in reward_names
    names |= reward_names
    for name in (M.REWARD, M.ROLLOUT_DURATION_S, M.ROLLOUT_SCORE_S,
                 M.ROLLOUT_SCORE_WAIT_S, M.ROLLOUT_CONCURRENCY,
                 M.COMPLETIONS_MEAN_TERMINATED_LENGTH, M.ROLLOUT_GENERATED_TOKENS_PER_S):
        assert name in names


def test_first_group_runs_alone_then_allowance_bounds_what_is_held():
    run = InProcess(ScriptedLoop, [index_reward], allowance=10)
    items = run.take(1, consume=False)
    tokens = sum(len(it.sample.token_ids) for it in items if isinstance(it, QueuedSample))
    assert tokens >= 12  # one group: 3 samples of >= 4 tokens, over the allowance
    time.sleep(0.5)
    # held back: nothing new started, and the loop said it waits on the trainer
    assert isinstance(run.next_item(timeout_s=0.1), RolloutIdle) and run.channel.samples.empty()
    run.consume(tokens)
    run.take(1)
    run.stop()
    waits = [r[1] for r in run.records() if r[0] == M.ROLLOUT_BACKPRESSURE_S]
    assert waits and max(waits) >= 0.4


class RejectAll(ScriptedLoop):
    def filter_prompt(self, row_index, row, epoch):
        return False


def test_a_filter_that_rejects_a_whole_epoch_stops_the_loop_with_an_error():
    run = InProcess(RejectAll, [index_reward], rows=4)
    run.thread.join(15)
    assert isinstance(run.error, ValueError) and "filter_prompt rejected all 4 prompts" in str(run.error)
    markers = []
    while True:
        try:
            markers.append(run.channel.samples.get(timeout=0.2))
        except queue.Empty:
            break
    assert [m.num_samples for m in markers] == [0, 0, 0, 0]


class BadAdvantages(ScriptedLoop):
    def compute_advantages(self, group):
        return np.zeros(len(group) + 1)


def test_compute_advantages_of_the_wrong_shape_is_an_error_that_names_the_hook():
    run = InProcess(BadAdvantages, [length_reward])
    run.thread.join(15)
    assert isinstance(run.error, ValueError) and "compute_advantages returned shape (4,)" in str(run.error)


async def stuck_reward(completions, **kwargs):
    await asyncio.sleep(60)
    return [0.0] * len(completions)


def test_a_stuck_reward_function_fails_the_loop_after_rollout_worker_timeout():
    run = InProcess(ScriptedLoop, [stuck_reward], rollout_worker_timeout=1.0)
    run.thread.join(20)
    assert isinstance(run.error, TimeoutError) and "rollout_worker_timeout=1" in str(run.error)


class FailingSetup(ScriptedLoop):
    async def setup(self):
        self.closed = False
        raise RuntimeError("the judge service is down")

    async def close(self):
        self.closed = True


def test_a_failing_setup_stops_the_loop_and_close_still_runs():
    run = InProcess(FailingSetup, [index_reward])
    run.thread.join(15)
    assert isinstance(run.error, RuntimeError) and "judge service is down" in str(run.error)
    assert run.loop.closed
    assert run.channel.samples.empty()


# -- telling the trainer that nothing more is coming ----------------------------------------------


def test_a_blocked_loop_with_nothing_in_flight_says_so_once_per_trainer_view():
    run = InProcess(ScriptedLoop, [index_reward], allowance=10)
    items = run.take(1, consume=False)  # the first group (over the allowance), then its marker
    assert run.idle == [] and isinstance(items[-1], GroupFinished)  # nothing said while it was in flight
    idle = run.next_item()
    assert idle == RolloutIdle("staleness", run.channel.trainer_view())
    assert run.next_item(timeout_s=0.5) is None  # the trainer did nothing: no repeat
    run.consume(1)  # not enough to start a group: still blocked, against new values
    again = run.next_item()
    assert again == RolloutIdle("staleness", run.channel.trainer_view())
    assert again.blocked_at.consumed_tokens == idle.blocked_at.consumed_tokens + 1
    run.stop()


def test_on_policy_loop_is_idle_after_one_step_until_the_version_moves():
    run = InProcess(ScriptedLoop, [index_reward], allowance=20, max_staleness=0)
    deadline = time.monotonic() + 20
    while True:  # play a trainer that takes every sample at once but never syncs the weights
        assert time.monotonic() < deadline
        item = run.next_item()
        if isinstance(item, QueuedSample):
            assert item.sample.model_version == 0
            run.consume(len(item.sample.token_ids))
        elif isinstance(item, RolloutIdle) and item.blocked_at == run.channel.trainer_view():
            break
    # nothing is held, so only the step's worth generated under version 0 blocks it
    assert item.reason == "on-policy" and not item.final
    assert run.next_item(timeout_s=0.5) is None
    run.channel.model_version.value = 1  # the weight sync
    new = run.take(1)
    assert new and all(it.sample.model_version == 1 for it in new if isinstance(it, QueuedSample))
    run.stop()


def constant_reward(completions, **kwargs):
    return [1.0] * len(completions)


@pytest.mark.slow
def test_on_policy_groups_that_give_the_trainer_nothing_do_not_fill_the_step():
    # every group is dropped (equal rewards): waiting for a sync would wait forever, since the trainer
    # has nothing to step on; the loop keeps generating under the same version instead
    run = InProcess(ScriptedLoop, [constant_reward], allowance=20, max_staleness=0, rows=12)
    markers = run.take(12, consume=False)
    assert [m.num_samples for m in markers] == [0] * 12
    assert run.idle == []
    run.stop()


def test_a_run_out_of_prompts_sends_a_final_idle_after_its_last_marker():
    run = InProcess(ScriptedLoop, [index_reward], rows=4, max_steps=-1, num_train_epochs=1)
    items = run.take(4)
    last = run.next_item()
    assert last == RolloutIdle("out of prompts", None) and last.final
    assert sum(isinstance(it, GroupFinished) for it in items) == 4
    assert run.next_item(timeout_s=0.5) is None
    run.stop()
