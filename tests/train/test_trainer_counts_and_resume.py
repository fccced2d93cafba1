"""What the trainer logs across windows and resumes: count metrics are 0 (not missing) in windows without
events, and `num_tokens` goes on from a checkpoint instead of restarting at 0. Real embedded server, CPU."""

from __future__ import annotations

import os

import pytest
from datasets import Dataset
from support.short_run import short_run_config

from asyncgrpo import AsyncGRPOTrainer
from asyncgrpo.checkpoint import read_rollout_state
from asyncgrpo.rewards import accuracy_reward
from asyncgrpo.tasks import arithmetic

pytestmark = pytest.mark.process

os.environ.setdefault("HF_HUB_OFFLINE", "1")
MODEL = "asyncgrpo/tiny-chat"
ALWAYS_COUNTED = (
    "sample/dropped_stale_count",
    "batch/dropped_oversize_count",
    "rollout/vllm_retry_count",
    "rollout/vllm_preemption_count",
    "optimizer/nonfinite_step_count",
)


@pytest.fixture
def server(embedded_server):
    return embedded_server(MODEL, purpose="trained")  # the trainers push weights into it


def _dataset() -> Dataset:
    return Dataset.from_list(arithmetic.make_dataset(64, seed=1))


def _logged(trainer) -> list[dict]:
    return [entry for entry in trainer.state.log_history if "loss" in entry]


@pytest.mark.slow
def test_count_metrics_are_zero_in_windows_without_events_then_num_tokens_resumes(tmp_path, server):
    out = tmp_path / "out"
    first = AsyncGRPOTrainer(
        model=MODEL,
        reward_funcs=accuracy_reward,
        train_dataset=_dataset(),
        args=short_run_config(out, server.url, max_steps=2, save_strategy="steps", save_steps=2),
    )
    first.train()
    logs = _logged(first)
    assert len(logs) == 2
    for entry in logs:
        for name in ALWAYS_COUNTED:
            assert name in entry, f"{name} missing from a logged window: {sorted(entry)}"
        assert entry["sample/dropped_stale_count"] == 0  # max_staleness=4 over two steps drops nothing
        assert entry["batch/dropped_oversize_count"] == 0  # token_budget is the server's max_model_len
    tokens_at_save = logs[-1]["num_tokens"]
    assert tokens_at_save > 0
    assert read_rollout_state(out / "checkpoint-2").num_tokens == tokens_at_save

    resumed = AsyncGRPOTrainer(
        model=MODEL,
        reward_funcs=accuracy_reward,
        train_dataset=_dataset(),
        args=short_run_config(out, server.url, max_steps=3),
    )
    resumed.train(resume_from_checkpoint=str(out / "checkpoint-2"))
    after = [
        entry for entry in _logged(resumed) if entry["step"] > 2
    ]  # the history holds the first run's too
    assert after and after[0]["num_tokens"] > tokens_at_save, (tokens_at_save, after[0]["num_tokens"])
