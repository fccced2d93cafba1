"""The inference server dies in the middle of training: the trainer stops within its retries (not
after `vllm_server_timeout`), with an error that names the server, says what happened in words and
what to do, and its rollout process goes with it."""

from __future__ import annotations

import multiprocessing
import time

import pytest
from datasets import Dataset
from fault_helpers import MODEL, short_run_config, spread_reward
from transformers import TrainerCallback

from asyncgrpo import AsyncGRPOTrainer
from asyncgrpo.generation.transport import ServerConnectionError
from asyncgrpo.launch import EmbeddedServer
from asyncgrpo.tasks import arithmetic

pytestmark = pytest.mark.process


class _KillServerAt(TrainerCallback):
    def __init__(self, server: EmbeddedServer, step: int) -> None:
        self.server, self.step = server, step
        self.killed_at: float | None = None

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step and self.killed_at is None:
            self.server.process.kill()
            self.killed_at = time.monotonic()


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_server_killed_mid_training_stops_the_trainer_with_what_to_do(tmp_path):
    with EmbeddedServer(MODEL, log_path=tmp_path / "server.log") as server:
        killer = _KillServerAt(server, step=2)
        trainer = AsyncGRPOTrainer(
            model=MODEL, reward_funcs=spread_reward, callbacks=[killer],
            args=short_run_config(tmp_path / "out", server.url, max_steps=100),
            train_dataset=Dataset.from_list(arithmetic.make_dataset(400, seed=0)),
        )
        with pytest.raises(ServerConnectionError) as err:
            trainer.train()
    assert killer.killed_at is not None and time.monotonic() - killer.killed_at < 90
    message = str(err.value)
    assert server.url in message and "does not answer" in message
    assert "its log says why; start it again and resume training from the last checkpoint" in message
    assert "ConnectionKey" not in message  # the cause in words, not aiohttp's nested repr
    assert trainer.state.global_step < 100
    deadline = time.monotonic() + 20  # the rollout process stopped with the trainer
    while multiprocessing.active_children() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not multiprocessing.active_children()
