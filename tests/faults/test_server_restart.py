"""The inference server restarts in the middle of training (a supervisor brings it back on the same port
within the trainer's retries): it then serves the weights it loaded at start, under vLLM's initial weight
version, and no longer has the trainer's weight-transfer group. Its tokens must not become samples
stamped with the trained policy's version, and the trainer must say what happened, not "Weight transfer
engine is not initialized"."""

from __future__ import annotations

import asyncio
import multiprocessing
import time

import pytest
from conftest import call
from datasets import Dataset
from fault_helpers import MODEL, short_run_config, spread_reward
from transformers import TrainerCallback

from asyncgrpo import AsyncGRPOTrainer
from asyncgrpo.generation.client import GenerationClient, ServerRestartedError
from asyncgrpo.generation.protocol import INITIAL_WEIGHT_VERSION, SamplingParams
from asyncgrpo.launch import EmbeddedServer
from asyncgrpo.tasks import arithmetic

PARAMS = SamplingParams(max_tokens=4, temperature=1.0, top_k=20, seed=0)


def _generate(url: str, expects_pushed_weights: bool, model: str | None = None):
    async def run():
        client = GenerationClient(url, timeout_s=60, max_retries=0)
        client.expects_pushed_weights = expects_pushed_weights
        await client.start()
        try:
            await client.detect()
            return await client.generate([1, 2, 3], PARAMS, model=model)
        finally:
            await client.close()

    return asyncio.run(run())


def test_tokens_of_the_initial_weights_are_an_error_once_a_trainer_pushed(tiny_server):
    assert _generate(tiny_server.url, expects_pushed_weights=False).weight_versions[0].version == INITIAL_WEIGHT_VERSION
    with pytest.raises(ServerRestartedError) as err:
        _generate(tiny_server.url, expects_pushed_weights=True)
    message = str(err.value)
    assert tiny_server.url in message and "restarted during training" in message
    assert "resume_from_checkpoint" in message
    assert call(tiny_server.url, "POST", "/update_weight_version", {"new_version": "step-3"})[0] == 200
    try:
        out = _generate(tiny_server.url, expects_pushed_weights=True)  # pushed weights: served as usual
        assert out.weight_versions[0].version == "step-3" and len(out.token_ids) == 4
    finally:
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
@pytest.mark.parametrize("weight_sync_steps, who", [
    (1, "the trainer's next push"),  # at the end of the step the restart interrupts
    (1000, "the rollout process"),  # no push for the rest of the run: the rollouts must see it
])
def test_a_server_restarted_mid_training_stops_the_trainer_saying_so(tmp_path, weight_sync_steps, who):
    with EmbeddedServer(MODEL, log_path=tmp_path / "server.log") as server:
        restart = _RestartServerAt(server, step=2)
        trainer = AsyncGRPOTrainer(
            model=MODEL, reward_funcs=spread_reward, callbacks=[restart],
            args=short_run_config(tmp_path / "out", server.url, max_steps=100, weight_sync_steps=weight_sync_steps),
            train_dataset=Dataset.from_list(arithmetic.make_dataset(400, seed=0)),
        )
        with pytest.raises((ServerRestartedError, RuntimeError)) as err:
            trainer.train()
        assert call(server.url, "GET", "/weight_info")[1] == {"weight_version": INITIAL_WEIGHT_VERSION}
    assert restart.restarted
    if who == "the rollout process":  # what was queued before the restart may still train; what came after not
        assert "The rollout process failed with ServerRestartedError" in str(err.value)
        # at most what was queued before the restart: the staleness window's worth of steps
        assert trainer.state.global_step <= 2 + trainer.args.max_staleness + 1, trainer.state.global_step
    else:
        assert isinstance(err.value, ServerRestartedError) and trainer.state.global_step == 2
    message = str(err.value)
    assert "restarted during training" in message and server.url in message, message
    assert "Weight transfer engine is not initialized" not in message.split("\n")[0]
    deadline = time.monotonic() + 20  # the rollout process stopped with the trainer
    while multiprocessing.active_children() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not multiprocessing.active_children()
