"""The rollout process shell: picklability errors, child tracebacks, heartbeat timeout, stop escalation.

The children run the real `AsyncRolloutLoop`; the subclasses below only replace `generate_one` (so no
inference server is needed) or block their event loop on purpose. They live at module level because
the spawned child imports them by reference.
"""

from __future__ import annotations

import asyncio
import functools
import multiprocessing as mp
import signal
import time

import pytest

from asyncgrpo.config import AsyncGRPOConfig
from asyncgrpo.rollout.channel import RolloutChannel
from asyncgrpo.rollout.loop import AsyncRolloutLoop
from asyncgrpo.rollout.spawn_inputs import check_picklable, check_spawn_inputs
from asyncgrpo.rollout.worker import RolloutWorker
from asyncgrpo.types import Rollout, TurnRecord

pytestmark = pytest.mark.process


def length_reward(completion_ids, **kwargs):
    return [float(len(ids)) for ids in completion_ids]


def exploding_reward(completion_ids, **kwargs):
    return [1.0 / 0 for _ in completion_ids]


class _CallableReward:
    def __call__(self, completions, **kwargs):
        return [0.0] * len(completions)


class OfflineLoop(AsyncRolloutLoop):
    """Generates a fixed one-turn rollout without a server."""

    async def generate_one(self, prompt, tools, group_id=0):
        await asyncio.sleep(0.01)
        return Rollout(
            completion=[{"role": "assistant", "content": "x"}],
            completion_ids=[7, 8],
            turns=[TurnRecord(prompt_ids=[1, 2, 3], output_ids=[7, 8], output_log_probs=[-0.5, -0.1])],
        )


class SlowCloseLoop(OfflineLoop):
    """Takes long to release its resources: a failure must reach the trainer before close() ends."""

    async def close(self):
        await asyncio.sleep(60)


class StuckLoop(AsyncRolloutLoop):
    """Blocks its event loop in setup() and ignores SIGTERM: only SIGKILL ends it."""

    async def setup(self):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        time.sleep(120)  # noqa: ASYNC251 -- a stuck event loop on purpose


def _config(**overrides) -> AsyncGRPOConfig:
    values = {"output_dir": "/tmp/asyncgrpo-test-worker", "num_generations": 2, "report_to": "none"}
    values.update(overrides)
    return AsyncGRPOConfig(**values)


def _loop_kwargs(reward_funcs, **config_overrides) -> dict:
    return {
        "config": _config(**config_overrides),
        "model_name": "offline",
        "dataset": [{"prompt": [{"role": "user", "content": f"q{i}"}]} for i in range(4)],
        "reward_funcs": reward_funcs,
        "processing_class": None,
        "eos_token_ids": [0],
    }


def _channel() -> RolloutChannel:
    return RolloutChannel.create(mp.get_context("spawn"), initial_allowance=10_000)


def test_check_picklable_names_a_lambda_reward():
    with pytest.raises(TypeError,
                       match=r"reward_funcs\[1\] \(<lambda>\) cannot be pickled.*module-level function"):
        check_spawn_inputs(AsyncRolloutLoop, {"reward_funcs": [length_reward, lambda **kw: [0.0]]})


def test_check_picklable_names_a_closure_tool():
    def make_tool():
        def lookup(key: str) -> str:
            return key

        return lookup

    with pytest.raises(TypeError, match=r"tools\[0\] \(.*lookup\) cannot be pickled.*functools.partial"):
        check_spawn_inputs(AsyncRolloutLoop, {"tools": [make_tool()]})


def test_check_picklable_accepts_module_functions_partials_and_instances():
    check_picklable(length_reward, "reward_funcs[0]")
    check_picklable(functools.partial(length_reward), "reward_funcs[1]")
    check_picklable(_CallableReward(), "reward_funcs[2]")
    check_spawn_inputs(OfflineLoop, {"environment_factory": {"a": _CallableReward}})
    with pytest.raises(TypeError, match=r"environment_factory\['b'\]"):
        check_spawn_inputs(OfflineLoop, {"environment_factory": {"b": lambda: None}})


def test_check_health_raises_with_the_child_traceback_when_a_reward_function_raises():
    channel = _channel()
    worker = RolloutWorker(SlowCloseLoop, _loop_kwargs([exploding_reward]), channel)
    worker.start()
    try:
        deadline = time.monotonic() + 40  # spawn + first group, well before close() (60 s) returns
        with pytest.raises(RuntimeError) as info:
            while time.monotonic() < deadline:
                worker.check_health()
                time.sleep(0.2)
        message = str(info.value)
        assert "exploding_reward" in message
        assert "ZeroDivisionError" in message
        assert "return [1.0 / 0 for _ in completion_ids]" in message  # the child's own source line
        assert time.monotonic() < deadline
        assert worker.is_alive()  # still in close(): the error was reported first
    finally:
        assert worker.stop(timeout=1, terminate_timeout=5) != 0


def test_a_healthy_worker_queues_samples_and_stops_cleanly():
    channel = _channel()
    worker = RolloutWorker(OfflineLoop, _loop_kwargs([length_reward]), channel)
    worker.start()
    try:
        item = channel.samples.get(timeout=60)  # equal lengths, equal rewards: every group is dropped
        assert item.num_samples == 0  # GroupFinished of a zero-std group
        worker.check_health()
        assert channel.heartbeat.value > 0
    finally:
        assert worker.stop(timeout=20) == 0
    worker.check_health()  # a requested stop is not a failure


@pytest.mark.slow
def test_stuck_child_times_out_on_heartbeat_and_stop_escalates_to_kill():
    channel = _channel()
    worker = RolloutWorker(StuckLoop, _loop_kwargs([length_reward]), channel, heartbeat_timeout_s=3.0)
    worker.start()
    try:
        deadline = time.monotonic() + 60
        while channel.heartbeat.value == 0.0 and time.monotonic() < deadline:  # spawned and beating once
            time.sleep(0.1)
        with pytest.raises(TimeoutError, match="rollout_worker_timeout"):
            while time.monotonic() < deadline:
                worker.check_health()
                time.sleep(0.5)
    finally:
        start = time.monotonic()
        exitcode = worker.stop(timeout=1.0, terminate_timeout=1.0)
    assert exitcode == -signal.SIGKILL
    assert time.monotonic() - start < 15
    assert not worker.is_alive()
