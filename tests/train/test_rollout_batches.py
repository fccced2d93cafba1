"""RolloutBatches: when a partial micro-batch is closed (the rollout process's RolloutIdle), and when not.

The test plays the rollout process: it puts samples, markers and RolloutIdle items on a real channel
and reads micro-batches from the iterator, which runs in a thread so a blocked `next()` is observable.
"""

from __future__ import annotations

import multiprocessing as mp
import threading
import time

import pytest

from asyncgrpo.packing import Sample, TokenBudgetBatcher
from asyncgrpo.rollout.channel import GroupFinished, QueuedSample, RolloutChannel, RolloutIdle, TrainerView
from asyncgrpo.train.progress import TrainedPrompts
from asyncgrpo.train.rollout_batches import RolloutBatches

BUDGET = 64


class Reader:
    """Pulls micro-batches from a RolloutBatches iterator in a background thread."""

    def __init__(self, batches: RolloutBatches) -> None:
        self.got: list = []
        self.done = threading.Event()
        self.error: BaseException | None = None
        self._want = threading.Semaphore(0)
        self._arrived = threading.Semaphore(0)
        self._iterator = iter(batches)
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        try:
            while True:
                self._want.acquire()
                try:
                    self.got.append(next(self._iterator))
                except StopIteration:
                    self.done.set()
                    return
                finally:
                    self._arrived.release()
        except _TestOver:
            return
        except BaseException as exc:  # noqa: BLE001 -- checked by the test
            self.error = exc
            self._arrived.release()

    def request(self) -> None:
        self._want.release()

    def arrived(self, timeout_s: float) -> bool:
        """Whether the requested micro-batch (or the end) came within `timeout_s`."""
        ok = self._arrived.acquire(timeout=timeout_s)
        assert self.error is None, self.error
        return ok


class _TestOver(Exception):
    """Raised by check_health after the test, so a reader blocked in `next()` exits."""


@pytest.fixture
def pipeline():
    """Factory of (channel, RolloutBatches); readers still blocked at teardown are released."""
    over = threading.Event()

    def check_health() -> None:
        if over.is_set():
            raise _TestOver

    yield lambda max_staleness=1: _pipeline(check_health, max_staleness)
    over.set()


def _pipeline(check_health, max_staleness: int):
    channel = RolloutChannel.create(mp.get_context("spawn"), initial_allowance=1_000)
    batches = RolloutBatches(
        channel=channel,
        batcher=TokenBudgetBatcher(token_budget=BUDGET, num_processes=1),
        progress=TrainedPrompts(0),
        check_health=check_health,
        current_version=lambda: int(channel.model_version.value),
        record=lambda name, value: None,
        add_record=lambda record: None,
        max_staleness=max_staleness,
        token_budget=BUDGET,
        total_positions=None,
        poll_s=0.05,
    )
    return channel, batches


def _put_group(channel: RolloutChannel, position: int, num_samples: int = 2, length: int = 8) -> None:
    """`num_samples` samples of one prompt (8 tokens each, distinct), then its marker."""
    for i in range(num_samples):
        tokens = [position + 1] + [100 + 10 * position + i] * (length - 1)
        sample = Sample(tokens, [j > 0 for j in range(length)], [0.0] * length, 1.0, position)
        channel.samples.put(QueuedSample(sample, position, position, time.time()))
    channel.samples.put(GroupFinished(position, position, num_samples))


def test_a_partial_micro_batch_waits_while_rollouts_are_in_flight(pipeline):
    channel, batches = pipeline()
    reader = Reader(batches)
    _put_group(channel, 0)  # 16 of 64 tokens; more is being generated
    reader.request()
    assert not reader.arrived(timeout_s=3.0)  # longer than any fixed flush delay: no premature flush
    for position in range(1, 5):
        _put_group(channel, position)  # the fourth group overflows the row: the first micro-batch closes
    assert reader.arrived(timeout_s=5.0)
    assert len(reader.got[0].samples) == 8


def test_the_partial_micro_batch_closes_right_after_the_rollout_process_is_idle(pipeline):
    channel, batches = pipeline(max_staleness=0)
    reader = Reader(batches)
    _put_group(channel, 0)
    reader.request()
    assert not reader.arrived(timeout_s=0.3)
    started = time.monotonic()
    channel.samples.put(RolloutIdle("on-policy", channel.trainer_view()))
    assert reader.arrived(timeout_s=5.0)
    assert time.monotonic() - started < 0.5  # at once, not after a timeout
    (micro_batch,) = reader.got
    assert len(micro_batch.samples) == 2 and micro_batch.positions == [0, 0]
    assert channel.consumed_tokens.value == 16


def test_an_outdated_idle_item_does_not_close_the_micro_batch(pipeline):
    channel, batches = pipeline()
    reader = Reader(batches)
    _put_group(channel, 0)
    view = channel.trainer_view()
    # the rollout process was blocked against values the trainer has moved past since (it consumed)
    outdated = TrainerView(view.model_version, view.token_allowance, view.consumed_tokens - 1)
    channel.samples.put(RolloutIdle("staleness", outdated))
    reader.request()
    assert not reader.arrived(timeout_s=1.0)
    channel.samples.put(RolloutIdle("staleness", channel.trainer_view()))  # still blocked: a fresh one
    assert reader.arrived(timeout_s=5.0)
    assert len(reader.got[0].samples) == 2


def test_out_of_prompts_trains_what_is_left_then_ends_the_iteration(pipeline):
    channel, batches = pipeline()
    reader = Reader(batches)
    _put_group(channel, 0)
    _put_group(channel, 1)
    channel.samples.put(RolloutIdle("out of prompts", None))
    reader.request()
    assert reader.arrived(timeout_s=5.0)
    assert len(reader.got[0].samples) == 4
    reader.request()
    assert reader.arrived(timeout_s=5.0) and reader.done.is_set()
    assert batches.progress.trained_position == 2


def test_a_staleness_idle_item_with_an_empty_batcher_changes_nothing(pipeline):
    """Blocked on the staleness limit with nothing queued: consuming frees the rollout process, so the
    trainer just waits."""
    channel, batches = pipeline()
    reader = Reader(batches)
    channel.samples.put(RolloutIdle("staleness", channel.trainer_view()))
    reader.request()
    assert not reader.arrived(timeout_s=0.5)  # nothing to train: keep waiting
    assert channel.token_allowance.value == 1_000
    _put_group(channel, 0)
    channel.samples.put(RolloutIdle("staleness", channel.trainer_view()))
    assert reader.arrived(timeout_s=5.0)
    assert len(reader.got[0].samples) == 2


def test_an_on_policy_idle_item_with_nothing_to_train_raises_the_quota(pipeline):
    """max_staleness=0, the version's quota spent and the trainer still short of samples (a second
    micro-batch of the step, or a step before the next weight sync): only consuming cannot free the
    rollout process, so the trainer raises the allowance by one micro-batch's worth."""
    channel, batches = pipeline(max_staleness=0)
    reader = Reader(batches)
    channel.samples.put(RolloutIdle("on-policy", channel.trainer_view()))
    reader.request()
    assert not reader.arrived(timeout_s=0.5)
    assert channel.token_allowance.value == 1_000 + BUDGET
    outdated = TrainerView(0, 1_000, 0)  # sent before the raise: ignored, no second raise
    channel.samples.put(RolloutIdle("on-policy", outdated))
    time.sleep(0.3)
    assert channel.token_allowance.value == 1_000 + BUDGET
    _put_group(channel, 0)  # what the rollout process generates with the raised quota
    channel.samples.put(RolloutIdle("on-policy", channel.trainer_view()))
    assert reader.arrived(timeout_s=5.0)
    assert len(reader.got[0].samples) == 2
    assert channel.token_allowance.value == 1_000 + BUDGET  # that idle item closed a micro-batch instead


def test_waiting_while_every_finished_prompt_was_dropped_is_a_warning(pipeline, caplog):
    channel, batches = pipeline()
    batches.notice_after_s = 0.2
    reader = Reader(batches)
    for position in range(3):
        channel.samples.put(GroupFinished(position, position, 0))  # zero reward std: nothing queued
    with caplog.at_level("INFO", logger="asyncgrpo.train.rollout_batches"):
        reader.request()
        assert not reader.arrived(timeout_s=1.0)
    warnings = [r for r in caplog.records if r.levelname == "WARNING"]
    assert warnings and "all 3 prompts finished so far were dropped" in warnings[0].getMessage()


def test_a_groups_metric_records_are_recorded_when_its_marker_is_read(pipeline):
    """A group's own records (reward, frac_reward_zero_std) ride its GroupFinished marker, so they
    are logged with the micro-batch that read the group, not whenever a separate queue delivers."""
    from asyncgrpo import metrics as M

    channel, batches = pipeline(max_staleness=0)
    recorded: list = []
    batches.add_record = recorded.append
    reader = Reader(batches)
    records = (M.metric(M.REWARD, 0.5), M.metric(M.FRAC_REWARD_ZERO_STD, 0.0))
    for i in range(2):
        tokens = [1] + [100 + i] * 7
        sample = Sample(tokens, [j > 0 for j in range(8)], [0.0] * 8, 1.0, 0)
        channel.samples.put(QueuedSample(sample, 0, 0, time.time()))
    channel.samples.put(GroupFinished(0, 0, 2, records))
    channel.samples.put(RolloutIdle("on-policy", channel.trainer_view()))
    reader.request()
    assert reader.arrived(timeout_s=5.0)
    assert recorded == list(records)
