"""The rollout process against a real embedded server and the bundled tiny model (CPU).

Each test starts a `RolloutWorker` (spawned, like the trainer does) and plays the trainer's part on
the channel: it takes samples and markers off the queue and, when it "trains" them, adds their tokens
to `consumed_tokens`. Reward functions and loop subclasses are module-level: the child imports them.
ASYNCGRPO_TEST_MODEL=<path> runs them against another local chat model instead of the bundled one.
"""

from __future__ import annotations

import math
import multiprocessing as mp
import os
import queue
import time
from collections import defaultdict
from dataclasses import dataclass

import numpy as np
import pytest

from asyncgrpo import AsyncGRPOConfig, AsyncGRPOTrainer, AsyncRolloutLoop  # the seed's import line
from asyncgrpo import metrics as M
from asyncgrpo.modeling.load import load_tokenizer, resolve_model_path
from asyncgrpo.rollout.channel import GroupFinished, QueuedSample, RolloutChannel, RolloutIdle
from asyncgrpo.rollout.worker import RolloutWorker
from asyncgrpo.tasks import arithmetic, counter

pytestmark = pytest.mark.process

os.environ.setdefault("HF_HUB_OFFLINE", "1")
MODEL = os.environ.get("ASYNCGRPO_TEST_MODEL", "asyncgrpo/tiny-chat")
G = 4


# -- module-level pieces the spawned child imports ------------------------------------------------


def parity_reward(completions, answer, **kwargs):
    """Equal rewards (a zero-std group) for even answers; the rollout's index in the group otherwise."""
    if int(answer[0]) % 2 == 0:
        return [1.0] * len(completions)
    return [float(i) for i in range(len(completions))]


def index_reward(completions, **kwargs):
    """Never a zero-std group: the rollout's index in the group."""
    return [float(i) for i in range(len(completions))]


def pass_by_row(completions, idx, **kwargs):
    """Even rows pass 3 of 4 rollouts (pass rate 0.75), odd rows 1 of 4 (0.25)."""
    return [1.0, 1.0, 1.0, 0.0] if idx[0] % 2 == 0 else [0.0, 0.0, 0.0, 1.0]


# The seed's curriculum example, unchanged (its import line is at the top of this file).

@dataclass
class CurriculumConfig(AsyncGRPOConfig):
    pass_rate_cap: float = 0.9


class CurriculumRolloutLoop(AsyncRolloutLoop):
    def filter_prompt(self, row_index, row, epoch):
        return self.pass_rates.get(row_index, 0.0) < self.config.pass_rate_cap

    async def setup(self):
        self.pass_rates = {}

    def compute_advantages(self, group):
        scored = group.rewards[~np.isnan(group.rewards)]
        if len(scored):
            self.pass_rates[group.row_index] = float(np.mean(scored > 0))
        return super().compute_advantages(group)


class CurriculumTrainer(AsyncGRPOTrainer):
    loop_cls = CurriculumRolloutLoop


# -- fixtures and the trainer's side ---------------------------------------------------------------


@pytest.fixture
def server(embedded_server):
    """The pool's plain server of MODEL: these tests only generate, so they share it."""
    try:
        resolve_model_path(MODEL)
    except FileNotFoundError as exc:
        pytest.skip(f"{exc} (or set ASYNCGRPO_TEST_MODEL to a local chat model)")
    return embedded_server(MODEL)


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(MODEL)


def _config(tmp_path, server, cls=AsyncGRPOConfig, **overrides):
    values = {
        "output_dir": str(tmp_path / "out"),
        "vllm_server_base_url": server.url,
        "num_generations": G,
        "max_completion_length": 32,
        "max_concurrent_rollouts": 8,
        "use_cpu": True,
        "bf16": False,
        "report_to": "none",
        "seed": 0,
    }
    values.update(overrides)
    return cls(**values)


class Trainer:
    """The trainer's side of the channel: takes items off the queue and counts consumed tokens."""

    def __init__(self, worker: RolloutWorker, channel: RolloutChannel) -> None:
        self.worker, self.channel = worker, channel
        self.samples: list[QueuedSample] = []
        self.markers: list[GroupFinished] = []
        self.records: list[tuple] = []
        self.order: list[object] = []  # samples and markers in queue order
        self.idle: list[RolloutIdle] = []  # the rollout process waiting on the trainer

    def take(self, num_markers: int, *, consume: bool = True, timeout_s: float = 120.0) -> None:
        """Take items until `num_markers` more markers arrived; consume the samples if asked."""
        target = len(self.markers) + num_markers
        deadline = time.monotonic() + timeout_s
        while len(self.markers) < target:
            assert time.monotonic() < deadline, (f"only {len(self.markers)}/{target} groups finished in "
                                                 f"{timeout_s} s")
            self.worker.check_health()
            try:
                item = self.channel.samples.get(timeout=0.2)
            except queue.Empty:
                continue
            if isinstance(item, RolloutIdle):
                self.idle.append(item)
                continue
            self.order.append(item)
            if isinstance(item, GroupFinished):
                self.markers.append(item)
                self.records.extend(tuple(r) for r in item.records)  # a group's records ride its marker
            else:
                self.samples.append(item)
                if consume:
                    self.consume([item])
        self.drain_metrics()

    def consume(self, items: list[QueuedSample]) -> None:
        with self.channel.consumed_tokens.get_lock():
            self.channel.consumed_tokens.value += sum(len(it.sample.token_ids) for it in items)

    def drain_metrics(self) -> None:
        while True:
            try:
                self.records.append(tuple(self.channel.metrics.get_nowait()))
            except queue.Empty:
                return

    def values(self, name: str, at_least: int = 0, timeout_s: float = 10.0) -> list[float]:
        """Values recorded under `name`, waiting up to `timeout_s` for `at_least` of them (the metrics
        queue is not ordered with the sample queue)."""
        deadline = time.monotonic() + timeout_s
        while True:
            self.drain_metrics()
            values = [r[1] for r in self.records if r[0] == name]
            if len(values) >= at_least or time.monotonic() > deadline:
                return values
            time.sleep(0.05)


def _start(loop_cls, config, tokenizer, reward_funcs, dataset, *, allowance=1_000_000, **kwargs):
    channel = RolloutChannel.create(mp.get_context("spawn"), initial_allowance=allowance)
    loop_kwargs = dict(
        config=config,
        model_name=MODEL,
        dataset=dataset,
        reward_funcs=reward_funcs,
        processing_class=tokenizer,
        eos_token_ids=[tokenizer.convert_tokens_to_ids("<|im_end|>"), tokenizer.eos_token_id],
        **kwargs,
    )
    worker = RolloutWorker(loop_cls, loop_kwargs, channel)
    worker.start()
    return worker, Trainer(worker, channel)


# -- tests -----------------------------------------------------------------------------------------


@pytest.mark.slow
def test_samples_markers_advantages_and_zero_std_groups(tmp_path, server, tokenizer):
    dataset = arithmetic.make_dataset(8, seed=3)
    worker, trainer = _start(AsyncRolloutLoop, _config(tmp_path, server), tokenizer, [parity_reward], dataset)
    try:
        trainer.take(len(dataset))
        trainer.values(M.REWARD, at_least=G * len(trainer.markers))  # let the metrics catch up
    finally:
        assert worker.stop(timeout=20) == 0

    by_position: dict[int, list[QueuedSample]] = defaultdict(list)
    for item in trainer.order:  # every sample of a prompt is queued before its marker
        if isinstance(item, QueuedSample):
            by_position[item.position].append(item)
        else:
            assert len(by_position[item.position]) == item.num_samples
    # groups finish out of order; each position is reported once
    assert len({m.position for m in trainer.markers}) == len(trainer.markers)

    num_dropped = 0
    for marker in trainer.markers:
        row = dataset[marker.row_index]
        items = by_position[marker.position]
        if int(row["answer"]) % 2 == 0:
            assert marker.num_samples == 0, "a zero-std group must be dropped"
            num_dropped += 1
            continue
        # one turn per rollout: one sample each, advantage = standardised index, summing to zero
        assert marker.num_samples == G
        advantages = sorted(it.sample.advantage for it in items)
        expected = (np.arange(G) - 1.5) / (np.arange(G).std() + 1e-8)
        np.testing.assert_allclose(advantages, expected, rtol=1e-6)
        assert abs(sum(advantages)) < 1e-6
        prompt_ids = tokenizer.apply_chat_template(row["prompt"], add_generation_prompt=True,
                                                   tokenize=True, return_dict=False)
        for it in items:
            s = it.sample
            assert list(s.token_ids[: len(prompt_ids)]) == list(prompt_ids)
            assert not s.trained_mask[: len(prompt_ids)].any() and s.trained_mask[len(prompt_ids) :].all()
            assert (s.sampler_logprobs[s.trained_mask] <= 0).all()
            assert s.model_version == 0 and s.group_id >= 0 and it.row_index == marker.row_index
            # score centering's top-K
            assert s.sampler_topk_ids is not None and 1 <= s.sampler_topk_ids.shape[1] <= 8
        assert len({it.sample.rollout_id for it in items}) == G
    assert num_dropped > 0

    # metrics are sent before a group's marker (more groups may have been scored meanwhile)
    zero_std = trainer.values(M.FRAC_REWARD_ZERO_STD)
    assert set(zero_std) <= {0.0, 1.0} and sum(zero_std) >= num_dropped
    assert len(zero_std) - sum(zero_std) >= len(trainer.markers) - num_dropped
    assert len(trainer.values(M.REWARD_DROPPED)) >= G * num_dropped
    assert len(trainer.values(M.REWARD_KEPT)) >= G * (len(trainer.markers) - num_dropped)
    assert len(trainer.values(M.ROLLOUT_DURATION_S)) >= G * len(trainer.markers)
    lengths = trainer.values(M.COMPLETIONS_MEAN_LENGTH)
    assert lengths and all(1 <= n <= 32 for n in lengths)
    rates = [r for r in trainer.records if r[0] == M.ROLLOUT_GENERATED_TOKENS_PER_S]
    assert rates and all(r[2] is not None and r[2] > 0 for r in rates)  # rate records: tokens / seconds


@pytest.mark.slow
def test_token_allowance_holds_generation_back_until_the_trainer_consumes(tmp_path, server, tokenizer):
    dataset = arithmetic.make_dataset(6, seed=4)
    worker, trainer = _start(
        AsyncRolloutLoop, _config(tmp_path, server), tokenizer, [index_reward], dataset, allowance=1
    )
    try:
        trainer.take(1, consume=False)
        # the queued group holds more than the allowance of 1 token: nothing new may start, and the
        # rollout process says it waits on the trainer
        time.sleep(3.0)
        trainer.drain_metrics()
        idle = trainer.channel.samples.get(timeout=1.0)
        assert idle == RolloutIdle("staleness", trainer.channel.trainer_view())
        assert trainer.channel.samples.empty()
        assert trainer.values(M.ROLLOUT_BACKPRESSURE_S) == []
        trainer.consume(trainer.samples)
        trainer.take(1)
    finally:
        assert worker.stop(timeout=20) == 0
    waits = trainer.values(M.ROLLOUT_BACKPRESSURE_S)
    assert waits and max(waits) >= 2.5


@pytest.mark.slow
def test_seed_curriculum_loop_runs_unchanged(tmp_path, server, tokenizer):
    dataset = [dict(row, idx=i) for i, row in enumerate(arithmetic.make_dataset(4, seed=5))]
    config = _config(tmp_path, server, cls=CurriculumConfig, pass_rate_cap=0.5)
    # allowance 1: one group at a time, so each filter_prompt sees every earlier group's pass rate
    worker, trainer = _start(CurriculumRolloutLoop, config, tokenizer, [pass_by_row], dataset, allowance=1)
    try:
        trainer.take(2 * len(dataset))
    finally:
        assert worker.stop(timeout=20) == 0
    for marker in trainer.markers:
        epoch = marker.position // len(dataset)
        # from the second epoch on (the worker may start a third before it stops), even rows have
        # pass rate 0.75 >= cap 0.5
        rejected = epoch >= 1 and marker.row_index % 2 == 0
        assert marker.num_samples == (0 if rejected else G), marker


@pytest.mark.slow
def test_counter_environment_runs_the_tool_loop(tmp_path, server, tokenizer):
    dataset = counter.make_dataset(4, seed=6)
    config = _config(tmp_path, server, max_tool_calling_iterations=8,
                     chat_template_kwargs={"enable_thinking": False})
    # index_reward alongside the environment's get_reward keeps every group (and its samples)
    worker, trainer = _start(
        AsyncRolloutLoop, config, tokenizer, [index_reward], dataset, environment_factory=counter.IncrementEnv
    )
    try:
        trainer.take(len(dataset))
        calls = trainer.values(M.TOOLS_CALL_FREQUENCY, at_least=G * len(dataset))
        assert len(trainer.values(M.ENV_RESET_S, at_least=G * len(dataset))) >= G * len(dataset)
        assert len(trainer.values(M.ENV_REWARD_S, at_least=G * len(dataset))) >= G * len(dataset)
    finally:
        assert worker.stop(timeout=20) == 0
    assert len(calls) >= G * len(dataset) and sum(calls) > 0, "the tiny model never called increment"
    assert max(trainer.values(M.ROLLOUT_TURNS_MAX)) >= 2
    assert trainer.values(M.tool_call_count("increment"))
    # every turn of a multi-turn rollout is trained (tool results between turns are context only)
    spans: dict[str, int] = defaultdict(int)
    for it in trainer.samples:
        mask = it.sample.trained_mask.astype(int)
        spans[it.sample.rollout_id] += int(np.diff(np.concatenate([[0], mask])).clip(min=0).sum())
        assert math.isfinite(it.sample.advantage)
    assert spans and max(spans.values()) >= 2
