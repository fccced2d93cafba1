"""One of two inference servers dies in the middle of training and comes back later: training goes on with
the other (its requests are sent there, a WARNING names it), and once it answers again it gets the
trainer's weights and is back in; both end serving the trainer's weights (`train/weights/every_server.py`,
`rollout/server_load.py`)."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import threading
import time

import pytest
import torch
from datasets import Dataset
from fault_helpers import MODEL, short_run_config, spread_reward
from transformers import TrainerCallback

from asyncgrpo import AsyncGRPOTrainer
from asyncgrpo.generation.client import GenerationClient
from asyncgrpo.launch import EmbeddedServer
from asyncgrpo.sync.checksum import checksum_mismatches, weights_checksum
from asyncgrpo.tasks import arithmetic
from asyncgrpo.train.weights.gather import weights_for_server

pytestmark = pytest.mark.process

AWAY_S = 25.0  # longer than the requests' retries (about 20 s): it is left out, not waited for


@pytest.fixture
def survivor(embedded_server):
    return embedded_server(MODEL, purpose="failover-survivor")


class _KillThenRestart(TrainerCallback):
    """Kill `server` at the end of step 1 (before that step's sync), start it again AWAY_S later; stop the
    run once the trainer took it back in and the rollout process sent it requests again."""

    def __init__(self, server: EmbeddedServer) -> None:
        self.server = server
        self.restarter: threading.Timer | None = None
        self.trainer: AsyncGRPOTrainer | None = None
        self.was_out = False
        self.generated_after_restart = 0.0

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == 1 and self.restarter is None:
            self.server.process.kill()
            self.server.process.wait()
            self.restarter = threading.Timer(AWAY_S, self.server.start)
            self.restarter.start()
        out = self.trainer.weights.out
        self.was_out = self.was_out or bool(out)
        if self.was_out and not out:  # back in for the trainer: is it generating again?
            self.generated_after_restart = _generated_tokens(self.server.url)  # its counters began at 0
            # this step's sync (after this callback) reaches both servers
            control.should_training_stop = self.generated_after_restart > 0


def _generated_tokens(url: str) -> float:
    async def fetch():
        async with GenerationClient(url, timeout_s=30) as client:
            return (await client.metrics()).generation_tokens or 0.0

    return asyncio.run(fetch())


async def _served(url: str) -> tuple[dict[str, str], str]:
    async with GenerationClient(url, timeout_s=60) as client:
        return await client.weight_checksum(), await client.weight_info()


def _two_server_trainer(tmp_path, urls: list[str], callback: TrainerCallback,
                        max_steps: int) -> AsyncGRPOTrainer:
    return AsyncGRPOTrainer(
        model=MODEL, reward_funcs=spread_reward, callbacks=[callback],
        args=short_run_config(tmp_path / "out", urls, max_steps=max_steps),
        train_dataset=Dataset.from_list(arithmetic.make_dataset(2000, seed=0)),
    )


def _assert_serving_the_trainers_weights(trainer: AsyncGRPOTrainer, served: dict) -> None:
    ours = weights_checksum(weights_for_server(trainer.model, torch.float32))
    for url, (checksum, version) in served.items():
        assert checksum_mismatches(ours, checksum) == [], f"{url} does not serve the trainer's weights"
        assert version == trainer.model_version.label(), (url, version)


@pytest.mark.slow  # about 70 s on two cores: a server start, the requests' retries, the server away
@pytest.mark.timeout(300)
def test_a_dead_server_is_left_out_training_goes_on_and_it_rejoins_with_the_weights(tmp_path, caplog, capfd,
                                                                                    survivor):
    with EmbeddedServer(MODEL, log_path=tmp_path / "server.log") as lost:
        callback = _KillThenRestart(lost)
        trainer = _two_server_trainer(tmp_path, [survivor.url, lost.url], callback, max_steps=500)
        callback.trainer = trainer
        try:
            with caplog.at_level(logging.WARNING):
                trainer.train()
        finally:
            if callback.restarter is not None:
                callback.restarter.join()
        served = {url: asyncio.run(_served(url)) for url in (survivor.url, lost.url)}
    assert callback.was_out and not trainer.weights.out, "the server never rejoined"
    assert callback.generated_after_restart > 0, "the rollout process never sent it requests again"
    assert 2 <= trainer.state.global_step < 500  # it stopped once the server was back
    assert f"the inference server at {lost.url} does not answer" in caplog.text
    assert "training goes on with the other 1 server(s)" in caplog.text
    assert f"the inference server at {lost.url} answers again and serves the trainer's weights" in caplog.text
    rollout_log = capfd.readouterr().err  # the rollout process's requests went to the other server, then back
    assert f"the inference server at {lost.url} does not answer" in rollout_log, rollout_log[-3000:]
    assert f"the inference server at {lost.url} answers again" in rollout_log, rollout_log[-3000:]
    _assert_serving_the_trainers_weights(trainer, served)


FROZEN_S = 20.0


class _FreezeThenThaw(TrainerCallback):
    """SIGSTOP `server` at the end of step 1 (before that step's sync), SIGCONT it FROZEN_S later."""

    def __init__(self, server: EmbeddedServer) -> None:
        self.server = server
        self.thaw: threading.Timer | None = None
        self.frozen_at = 0.0
        self.step_ends: list[float] = []

    def on_step_end(self, args, state, control, **kwargs):
        self.step_ends.append(time.monotonic())
        if state.global_step == 1 and self.thaw is None:
            os.kill(self.server.process.pid, signal.SIGSTOP)
            self.frozen_at = time.monotonic()
            self.thaw = threading.Timer(FROZEN_S, os.kill, (self.server.process.pid, signal.SIGCONT))
            self.thaw.start()


@pytest.mark.slow  # about 60 s on two cores: a server start, the freeze
@pytest.mark.timeout(300)
def test_a_server_frozen_for_20_s_holds_training_up_then_both_serve_the_trainers_weights(tmp_path, survivor):
    """What a frozen server does today: its requests and the sync's pause wait for it (no request fails,
    none is sent elsewhere), then training goes on with both servers and nothing is lost."""
    with EmbeddedServer(MODEL, log_path=tmp_path / "server.log") as frozen:
        callback = _FreezeThenThaw(frozen)
        trainer = _two_server_trainer(tmp_path, [survivor.url, frozen.url], callback, max_steps=4)
        try:
            trainer.train()
        finally:
            if callback.thaw is not None:
                callback.thaw.join()
                os.kill(frozen.process.pid, signal.SIGCONT)
        served = {url: asyncio.run(_served(url)) for url in (survivor.url, frozen.url)}
    assert trainer.state.global_step == 4 and not trainer.weights.out
    # step 1's sync waited for the thaw
    assert callback.step_ends[1] - callback.frozen_at >= FROZEN_S - 1, callback.step_ends
    _assert_serving_the_trainers_weights(trainer, served)
