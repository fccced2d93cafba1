"""RolloutBatches stops a run that has had no trainable sample for `rollout_worker_timeout` seconds while
the rollout process keeps finishing groups that are all dropped, naming the drop counts and their causes.

The test plays the rollout process on a real channel; the iterator runs in a thread."""

from __future__ import annotations

import multiprocessing as mp
import threading
import time

from asyncgrpo import metrics as M
from asyncgrpo.packing import Sample, TokenBudgetBatcher
from asyncgrpo.rollout.channel import GroupFinished, QueuedSample, RolloutChannel
from asyncgrpo.train.progress import TrainedPrompts
from asyncgrpo.train.rollout_batches import RolloutBatches

BUDGET = 64
TIMEOUT_S = 1.0


class Feeder:
    """Puts one item every `every_s` seconds until stopped, as a rollout process finishing groups."""

    def __init__(self, channel, make_item, every_s: float = 0.05) -> None:
        self.stop = threading.Event()
        self.count = 0

        def run():
            while not self.stop.wait(every_s):
                channel.samples.put(make_item(self.count))
                self.count += 1

        threading.Thread(target=run, daemon=True).start()


def _pipeline(max_staleness: int = 1):
    channel = RolloutChannel.create(mp.get_context("spawn"), initial_allowance=1_000)
    batches = RolloutBatches(
        channel=channel,
        batcher=TokenBudgetBatcher(token_budget=BUDGET, num_processes=1),
        progress=TrainedPrompts(0),
        check_health=lambda: None,
        current_version=lambda: int(channel.model_version.value),
        record=lambda name, value: None,
        add_record=lambda record: None,
        max_staleness=max_staleness,
        token_budget=BUDGET,
        total_positions=None,
        poll_s=0.05,
        no_sample_timeout_s=TIMEOUT_S,
    )
    return channel, batches


def _next_in_thread(batches, timeout_s: float):
    """next(iter(batches)) in a thread: ('raised', exc), ('item', value) or ('blocked', None)."""
    out = {}

    def run():
        try:
            out["item"] = next(iter(batches))
        except BaseException as exc:  # noqa: BLE001 -- returned to the test
            out["raised"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout_s)
    if "raised" in out:
        return "raised", out["raised"]
    if "item" in out:
        return "item", out["item"]
    return "blocked", None


def unscored(position):  # every reward None or NaN: the group's records hold no reward
    return GroupFinished(position, position, 0, (M.metric(M.FRAC_REWARD_ZERO_STD, 1.0),))


def equal_rewards(position):
    records = (M.metric(M.FRAC_REWARD_ZERO_STD, 1.0),) + (M.metric(M.REWARD, 0.0),) * 4
    return GroupFinished(position, position, 0, records)


def filtered(position):  # rejected by filter_prompt: a marker without records
    return GroupFinished(position, position, 0)


def test_a_run_whose_every_group_is_unscored_stops_naming_nan_rewards():
    channel, batches = _pipeline()
    feeder = Feeder(channel, unscored)
    started = time.monotonic()
    kind, exc = _next_in_thread(batches, timeout_s=10 * TIMEOUT_S)
    feeder.stop.set()
    assert kind == "raised", kind
    assert time.monotonic() - started < 5 * TIMEOUT_S
    message = str(exc)
    assert isinstance(exc, RuntimeError)
    assert f"rollout_worker_timeout={TIMEOUT_S:g}" in message
    assert "no scored rollout" in message and "None or NaN" in message
    assert "groups finished" in message and "all dropped" in message


def test_the_causes_are_counted_separately():
    channel, batches = _pipeline()
    makers = [unscored, equal_rewards, filtered]
    feeder = Feeder(channel, lambda i: makers[i % 3](i))
    kind, exc = _next_in_thread(batches, timeout_s=10 * TIMEOUT_S)
    feeder.stop.set()
    assert kind == "raised", kind
    message = str(exc)
    assert "equal rewards" in message and "reward 0" in message
    assert "filter_prompt" in message and "None or NaN" in message


def test_stale_samples_are_a_cause_too():
    channel, batches = _pipeline(max_staleness=1)
    channel.model_version.value = 5

    def stale(i):
        sample = Sample([1, 2, 3, 4], [False, True, True, True], [0.0] * 4, 1.0, i, model_version=0)
        return QueuedSample(sample, i, i, time.time())

    feeder = Feeder(channel, stale)
    kind, exc = _next_in_thread(batches, timeout_s=10 * TIMEOUT_S)
    feeder.stop.set()
    assert kind == "raised", kind
    assert "stale" in str(exc) and "max_staleness=1" in str(exc)


def test_a_slow_rollout_process_that_drops_nothing_is_not_stopped():
    channel, batches = _pipeline()
    kind, _ = _next_in_thread(batches, timeout_s=3 * TIMEOUT_S)  # nothing arrives: generation is slow
    assert kind == "blocked"
    channel.samples.put(GroupFinished(0, 0, 0))  # let the thread's iterator exit cleanly at teardown


def test_a_trainable_sample_restarts_the_clock():
    channel, batches = _pipeline()

    def trainable(i):
        return QueuedSample(
            Sample([1] + [i] * 7, [j > 0 for j in range(8)], [0.0] * 8, 1.0, i), i, i, time.time()
        )

    def feed():  # drops for 0.7 of the timeout, one trainable sample, drops again, then enough to close a row
        deadline = time.monotonic() + 0.7 * TIMEOUT_S
        for phase in range(2):
            while time.monotonic() < deadline:
                channel.samples.put(unscored(0))
                time.sleep(0.05)
            channel.samples.put(trainable(100 + phase))
            deadline = time.monotonic() + 0.7 * TIMEOUT_S
        for i in range(10):
            channel.samples.put(trainable(200 + i))

    threading.Thread(target=feed, daemon=True).start()
    kind, item = _next_in_thread(batches, timeout_s=10 * TIMEOUT_S)
    assert kind == "item", (kind, item)
