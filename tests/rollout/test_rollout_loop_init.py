"""AsyncRolloutLoop's constructor: the reference's signature (shared primitives one by one) and the
`channel=` form, both built here and in the spawned rollout process; `_SupportsReset`, the protocol of
what `environment_factory` makes."""

from __future__ import annotations

import asyncio
import inspect
import multiprocessing as mp
import threading
import time
from typing import Protocol

import pytest

from asyncgrpo import AsyncGRPOConfig, AsyncRolloutLoop, Rollout, TurnRecord
from asyncgrpo.rollout.channel import GroupFinished, QueuedSample, RolloutChannel
from asyncgrpo.rollout.worker import RolloutWorker

# The reference's AsyncRolloutLoop.__init__, in order.
REFERENCE_PARAMETERS = [
    "config",
    "model_name",
    "dataset",
    "reward_funcs",
    "processing_class",
    "eos_token_ids",
    "rollout_buffer",
    "model_version_value",
    "token_allowance",
    "heartbeat_value",
    "failed_event",
    "exception_info_queue",
    "metrics_queue",
    "tools",
    "environment_factory",
    "score_queue_maxsize",
    "lora_name",
    "dataset_start_index",
]
REFERENCE_DEFAULTS = {
    "tools": None,
    "environment_factory": None,
    "score_queue_maxsize": 16,
    "lora_name": None,
    "dataset_start_index": 0,
}


def index_reward(completions, **kwargs):
    return [float(i) for i in range(len(completions))]


class OfflineLoop(AsyncRolloutLoop):
    """One fixed turn per rollout, no server."""

    async def generate_one(self, prompt, tools, group_id=0):
        await asyncio.sleep(0.005)
        return Rollout(
            completion=[{"role": "assistant", "content": "x"}],
            completion_ids=[7, 0],
            turns=[TurnRecord(prompt_ids=[1, 2], output_ids=[7, 0], output_log_probs=[-0.5, -0.1])],
        )


class ReferenceStyleLoop(OfflineLoop):
    """Overrides __init__ with the reference's explicit signature, as a user of the reference writes it."""

    def __init__(
        self,
        config,
        model_name,
        dataset,
        reward_funcs,
        processing_class,
        eos_token_ids,
        rollout_buffer,
        model_version_value,
        token_allowance,
        heartbeat_value,
        failed_event,
        exception_info_queue,
        metrics_queue,
        tools=None,
        environment_factory=None,
        score_queue_maxsize=16,
        lora_name=None,
        dataset_start_index=0,
    ):
        super().__init__(
            config,
            model_name,
            dataset,
            reward_funcs,
            processing_class,
            eos_token_ids,
            rollout_buffer,
            model_version_value,
            token_allowance,
            heartbeat_value,
            failed_event,
            exception_info_queue,
            metrics_queue,
            tools,
            environment_factory,
            score_queue_maxsize,
            lora_name,
            dataset_start_index,
        )
        self.built_the_reference_way = True


def _config():
    return AsyncGRPOConfig(output_dir="/tmp/asyncgrpo-test-loop-init", num_generations=2, report_to="none")


def _common():
    dataset = [{"prompt": [{"role": "user", "content": f"q{i}"}]} for i in range(4)]
    return {
        "config": _config(),
        "model_name": "offline",
        "dataset": dataset,
        "reward_funcs": [index_reward],
        "processing_class": None,
        "eos_token_ids": [0],
    }


def _primitives(ctx):
    return {
        "rollout_buffer": ctx.Queue(),
        "model_version_value": ctx.Value("q", 0),
        "token_allowance": ctx.Value("q", 1_000_000),
        "heartbeat_value": ctx.Value("d", 0.0),
        "failed_event": ctx.Event(),
        "exception_info_queue": ctx.Queue(),
        "metrics_queue": ctx.Queue(),
    }


def test_the_signature_is_the_references_with_channel_as_a_keyword():
    params = inspect.signature(AsyncRolloutLoop.__init__).parameters
    names = [n for n in params if n != "self"]
    assert names[: len(REFERENCE_PARAMETERS)] == REFERENCE_PARAMETERS
    for name, default in REFERENCE_DEFAULTS.items():
        assert params[name].default == default
    assert params["channel"].kind is inspect.Parameter.KEYWORD_ONLY


def test_the_reference_form_runs_and_queues_samples_on_the_given_buffer():
    ctx = mp.get_context("spawn")
    prims = _primitives(ctx)
    loop = OfflineLoop(*_common().values(), *prims.values())  # positionally, in the reference's order
    assert loop.channel.samples is prims["rollout_buffer"] and loop.channel.metrics is prims["metrics_queue"]
    assert (
        loop.channel.heartbeat is prims["heartbeat_value"]
        and loop.channel.errors is prims["exception_info_queue"]
    )
    thread = threading.Thread(target=lambda: asyncio.run(loop.run()), daemon=True)
    thread.start()
    try:
        item = prims["rollout_buffer"].get(timeout=30)
        assert isinstance(item, (QueuedSample, GroupFinished))
        deadline = time.monotonic() + 10
        while prims["heartbeat_value"].value == 0.0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert prims["heartbeat_value"].value > 0
    finally:
        loop.channel.stop_event.set()
        thread.join(timeout=30)
    assert not thread.is_alive()
    loop.channel.close()


def test_the_channel_form_still_works():
    channel = RolloutChannel.create(mp.get_context("spawn"), initial_allowance=1_000)
    loop = OfflineLoop(**_common(), channel=channel)
    assert loop.channel is channel
    channel.close()


def test_a_form_missing_a_primitive_or_mixing_both_is_refused_naming_it():
    ctx = mp.get_context("spawn")
    prims = _primitives(ctx)
    del prims["heartbeat_value"]
    with pytest.raises(TypeError, match=r"heartbeat_value.*channel="):
        OfflineLoop(**_common(), **prims)
    channel = RolloutChannel.create(ctx, initial_allowance=1_000)
    with pytest.raises(TypeError, match="either `channel` or"):
        OfflineLoop(**_common(), **_primitives(ctx), channel=channel)
    channel.close()


@pytest.mark.slow
@pytest.mark.process
def test_a_subclass_with_the_references_init_runs_in_the_rollout_process():
    channel = RolloutChannel.create(mp.get_context("spawn"), initial_allowance=1_000_000)
    worker = RolloutWorker(ReferenceStyleLoop, _common(), channel)
    worker.start()
    try:
        item = channel.samples.get(timeout=60)
        assert isinstance(item, QueuedSample)  # index rewards differ: the group trains
        worker.check_health()
    finally:
        assert worker.stop(timeout=20) == 0  # the trainer's stop reaches a loop built the reference way


@pytest.mark.parametrize("path", ["asyncgrpo.async_grpo_trainer"])
def test_supports_reset_is_the_environment_protocol(path):
    import importlib

    proto = importlib.import_module(path)._SupportsReset
    assert issubclass(proto, Protocol)
    assert list(inspect.signature(proto.reset).parameters) == ["self", "kwargs"]

    class Env:
        def reset(self, **kwargs):
            return None

    assert isinstance(Env(), proto)
    assert not isinstance(object(), proto)
