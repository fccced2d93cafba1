"""The inference server restarts in the middle of training (a supervisor brings it back on the same port
within the trainer's retries): it then serves the weights it loaded at start, under vLLM's initial weight
version, and no longer has the trainer's weight-transfer group. Its tokens from those weights must not
become samples stamped with the trained policy's version; the trainer sets the transfer up again, pushes
its weights, and training goes on (`train/weights/restarts.py`)."""

from __future__ import annotations

import asyncio
import logging
import threading
import time

import pytest
import torch
from datasets import Dataset
from fault_helpers import MODEL, call, short_run_config, spread_reward
from transformers import TrainerCallback

from asyncgrpo import AsyncGRPOTrainer
from asyncgrpo.generation.client import GenerationClient, ServerRestartedError
from asyncgrpo.generation.protocol import INITIAL_WEIGHT_VERSION, SamplingParams, VersionSpan
from asyncgrpo.launch import EmbeddedServer
from asyncgrpo.sync.checksum import checksum_mismatches, weights_checksum
from asyncgrpo.tasks import arithmetic
from asyncgrpo.train.weights.gather import weights_for_server

pytestmark = pytest.mark.process

PARAMS = SamplingParams(max_tokens=4, temperature=1.0, top_k=20, seed=0)


def _generate(url: str, expects_pushed_weights: bool, timeout_s: float = 60):
    async def run():
        client = GenerationClient(url, timeout_s=timeout_s, max_retries=0)
        client.expects_pushed_weights = expects_pushed_weights
        await client.start()
        try:
            await client.detect()
            return await client.generate([1, 2, 3], PARAMS)
        finally:
            await client.close()

    return asyncio.run(run())


def test_tokens_of_the_initial_weights_are_asked_again_once_the_weights_are_pushed(tiny_server, caplog):
    """Once a trainer has pushed weights, a turn from the server's initial weights waits for pushed ones
    (said once) and comes back from them; with none within the client's timeout it is an error."""
    assert (
        _generate(tiny_server.url, expects_pushed_weights=False).weight_versions[0].version
        == INITIAL_WEIGHT_VERSION
    )
    with pytest.raises(ServerRestartedError) as err:
        _generate(tiny_server.url, expects_pushed_weights=True, timeout_s=2)
    message = str(err.value)
    assert tiny_server.url in message and "has served weights no trainer pushed for 2 s" in message
    assert "restarted during training" in message and "resume_from_checkpoint" in message

    pusher = threading.Timer(
        1.5, call, (tiny_server.url, "POST", "/update_weight_version", {"new_version": "step-3"})
    )
    pusher.start()
    try:
        with caplog.at_level(logging.WARNING, logger="asyncgrpo.generation.client"):
            t0 = time.monotonic()
            out = _generate(tiny_server.url, expects_pushed_weights=True)
        assert out.weight_versions == [VersionSpan("step-3", 0, 4)] and time.monotonic() - t0 >= 1.5
        assert "generated tokens with its initial weights ('default'): it restarted" in caplog.text
        assert "serves pushed weights again (step-3)" in caplog.text
    finally:
        pusher.join()
        call(tiny_server.url, "POST", "/update_weight_version", {"new_version": INITIAL_WEIGHT_VERSION})


class _RestartServerAt(TrainerCallback):
    def __init__(self, server: EmbeddedServer, step: int) -> None:
        self.server, self.step = server, step
        self.restarted = False

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step and not self.restarted:
            self.server.process.kill()
            self.server.process.wait()
            self.server.start()  # the same port, the weights it loads at start
            self.restarted = True


@pytest.mark.timeout(240)
@pytest.mark.parametrize("weight_sync_steps", [
    1,  # the trainer's next push (the restart interrupts the step) finds it
    1000,  # no push for the rest of the run: the trainer finds it while it waits for samples
])
@pytest.mark.slow
def test_a_server_restarted_mid_training_gets_the_weights_back_and_training_goes_on(tmp_path, caplog,
                                                                                  weight_sync_steps):
    with EmbeddedServer(MODEL, log_path=tmp_path / "server.log") as server:
        restart = _RestartServerAt(server, step=2)
        trainer = AsyncGRPOTrainer(
            model=MODEL,
            reward_funcs=spread_reward,
            callbacks=[restart],
            args=short_run_config(
                tmp_path / "out", server.url, max_steps=6, weight_sync_steps=weight_sync_steps
            ),
            train_dataset=Dataset.from_list(arithmetic.make_dataset(400, seed=0)),
        )
        with caplog.at_level(logging.WARNING):
            trainer.train()
        version = call(server.url, "GET", "/weight_info")[1]["weight_version"]
        served = asyncio.run(_served_checksum(server.url))
    assert restart.restarted and trainer.state.global_step == 6
    assert trainer.weights.recoveries == 1
    assert f"the inference server at {server.url} restarted" in caplog.text
    if weight_sync_steps == 1:  # the server ends with the trained weights
        assert version == "v6"
        sent = weights_checksum(weights_for_server(trainer.model, torch.float32))
        assert checksum_mismatches(sent, served) == []
    else:  # pushed back once, while the trainer waited for samples (after what was queued before the
        # restart), labelled with the version the run is at: no sync since the initial push
        assert version == "v0", version


async def _served_checksum(url: str) -> dict[str, str]:
    async with GenerationClient(url, timeout_s=60) as client:
        return await client.weight_checksum()


class _StopServerAt(TrainerCallback):
    """Kill the server at the end of `step` and start it again `away_s` later (a supervisor's restart)."""

    def __init__(self, server: EmbeddedServer, step: int, away_s: float) -> None:
        self.server, self.step, self.away_s = server, step, away_s
        self.restarter: threading.Timer | None = None

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step and self.restarter is None:
            self.server.process.kill()
            self.server.process.wait()
            self.restarter = threading.Timer(self.away_s, self.server.start)
            self.restarter.start()


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("weight_sync_steps", [
    1,  # the trainer's next pause waits for the server
    1000,  # no push for the rest of the run: the trainer's check while it waits for samples waits for it
])
def test_a_server_away_longer_than_the_retries_is_waited_for_with_vllm_server_restart_timeout(
    tmp_path, caplog, weight_sync_steps
):
    """Away ~25 s, past the requests' ~20 s of retries: with vllm_server_restart_timeout the rollout process
    and the trainer wait for it, and the run ends with the trained weights in the server."""
    with EmbeddedServer(MODEL, log_path=tmp_path / "server.log") as server:
        stop = _StopServerAt(server, step=2, away_s=25)
        trainer = AsyncGRPOTrainer(
            model=MODEL, reward_funcs=spread_reward, callbacks=[stop],
            args=short_run_config(tmp_path / "out", server.url, max_steps=5, vllm_server_restart_timeout=120,
                                  weight_sync_steps=weight_sync_steps),
            train_dataset=Dataset.from_list(arithmetic.make_dataset(400, seed=0)),
        )
        try:
            with caplog.at_level(logging.WARNING):
                trainer.train()
        finally:
            stop.restarter.join()
        version = call(server.url, "GET", "/weight_info")[1]["weight_version"]
        served = asyncio.run(_served_checksum(server.url))
    assert trainer.state.global_step == 5 and trainer.weights.recoveries == 1
    assert "waiting up to vllm_server_restart_timeout=120s for it to come back" in caplog.text
    assert f"the inference server at {server.url} restarted" in caplog.text
    if weight_sync_steps == 1:
        assert version == "v5"
        assert (
            checksum_mismatches(weights_checksum(weights_for_server(trainer.model, torch.float32)), served)
            == []
        )
    else:  # pushed back once, while the trainer waited for samples, labelled with the run's version
        assert version == "v0", version
