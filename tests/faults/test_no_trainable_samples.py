"""A run whose every group is dropped (a reward that is NaN for every completion) stops after
`rollout_worker_timeout` seconds without a trainable sample, with an error naming the drops and their
cause, instead of warning forever. Real trainer, rollout process and embedded server (CPU)."""

from __future__ import annotations

import math
import time

import pytest
from fault_helpers import MODEL, short_run_config

from asyncgrpo import AsyncGRPOTrainer
from asyncgrpo.tasks import arithmetic

pytestmark = pytest.mark.process

TIMEOUT_S = 20.0  # above the rollout process start-up on a busy CPU (the heartbeat shares this knob)


def nan_reward(completions, **kwargs) -> list[float]:
    return [math.nan] * len(completions)


@pytest.mark.slow
def test_a_reward_nan_for_every_completion_stops_the_run_naming_the_cause(tmp_path, server):
    trainer = AsyncGRPOTrainer(
        model=MODEL, reward_funcs=nan_reward, train_dataset=arithmetic.make_dataset(256, seed=0),
        args=short_run_config(tmp_path, server.url, max_steps=3, rollout_worker_timeout=TIMEOUT_S),
    )
    started = time.monotonic()
    with pytest.raises(RuntimeError) as info:
        trainer.train()
    elapsed = time.monotonic() - started
    message = str(info.value)
    assert "no trainable sample" in message and f"rollout_worker_timeout={TIMEOUT_S:g}" in message
    assert "None or NaN" in message and "all dropped" in message
    assert elapsed < TIMEOUT_S + 90, elapsed  # start-up, then the timeout: not forever
    assert trainer.state.global_step == 0
