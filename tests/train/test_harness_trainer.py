"""HarnessAsyncGRPOTrainer end to end against a real embedded server (CPU, bundled tiny model): an `openai`
SDK agent trains the model; harnesses that raise, hang or never call the model are counted and warned
about, never fatal; a command harness trains too. The harnesses are module-level: the spawned rollout
process imports this module to find them.
"""

from __future__ import annotations

import asyncio
import os
import random
import sys
import time
from pathlib import Path

import openai
import pytest
import torch
from datasets import Dataset

from asyncgrpo import AsyncGRPOConfig, HarnessAsyncGRPOTrainer, HarnessCommand
from asyncgrpo.rewards import accuracy_reward
from asyncgrpo.tasks import arithmetic

pytestmark = pytest.mark.process

os.environ.setdefault("HF_HUB_OFFLINE", "1")
MODEL = "asyncgrpo/tiny-chat"
AGENT = Path(__file__).with_name("harness_agent.py")


@pytest.fixture
def server(embedded_server):
    return embedded_server(MODEL, purpose="trained")  # the trainers push weights into it


def _config(tmp_path, server, **overrides) -> AsyncGRPOConfig:
    kwargs = {
        "output_dir": str(tmp_path / "out"), "vllm_server_base_url": server.url, "num_generations": 4,
        "max_completion_length": 32, "learning_rate": 1e-4, "bf16": False, "use_cpu": True,
        "gradient_checkpointing": False, "save_strategy": "no", "report_to": "none", "disable_tqdm": True,
        "logging_steps": 1, "seed": 0,
        "token_budget": 192,  # rows of two or three groups: a step waits for fewer harness runs
    }
    kwargs.update(overrides)
    return AsyncGRPOConfig(**kwargs)


def _dataset(n: int) -> Dataset:
    return Dataset.from_list(arithmetic.make_dataset(n, seed=0))


def _logged(trainer) -> list[dict]:
    return [entry for entry in trainer.state.log_history if "loss" in entry]


async def sdk_agent(run):
    """Asks, then asks the task again from scratch, streamed (the history is rewritten: a fork);
    reward_funcs score the last answer."""
    client = openai.AsyncOpenAI(base_url=run.base_url, api_key=run.api_key, max_retries=0)
    await client.chat.completions.create(model=run.model, messages=run.prompt)
    stream = await client.chat.completions.create(model=run.model, messages=run.prompt, stream=True)
    async for _ in stream:  # streamed: recorded all the same
        pass


def flaky_agent(run):
    """A sync agent whose rollouts, by their id, raise, hang past harness_timeout, skip the model or
    answer."""
    kind = int(run.rollout_id, 16) % 8
    if kind == 0:
        raise RuntimeError("the agent crashed")
    if kind == 1:
        time.sleep(3.0)  # harness_timeout is 1 s
    if kind == 2:
        return 1.0  # never called the model
    client = openai.OpenAI(base_url=run.base_url, api_key=run.api_key, max_retries=0)
    reply = client.chat.completions.create(model=run.model, messages=run.prompt)
    return float(len(reply.choices[0].message.content or "") % 3)


_RUNNING = {"now": 0, "peak": 0}  # in the rollout process, where the harness runs


async def counting_agent(run):
    """Notes how many runs are in flight at once (in the file named by $PEAK_FILE); a random reward."""
    _RUNNING["now"] += 1
    _RUNNING["peak"] = max(_RUNNING["peak"], _RUNNING["now"])
    Path(os.environ["PEAK_FILE"]).write_text(str(_RUNNING["peak"]))
    try:
        await asyncio.sleep(0.2)
        client = openai.AsyncOpenAI(base_url=run.base_url, api_key=run.api_key, max_retries=0)
        await client.chat.completions.create(model=run.model, messages=run.prompt, max_tokens=4)
        return random.random()
    finally:
        _RUNNING["now"] -= 1


@pytest.mark.slow
def test_max_concurrent_harnesses_bounds_the_runs_in_flight(tmp_path, server, monkeypatch):
    monkeypatch.setenv("PEAK_FILE", str(tmp_path / "peak"))  # the spawned rollout process inherits it
    trainer = HarnessAsyncGRPOTrainer(
        model=MODEL, harness=counting_agent, train_dataset=_dataset(64),
        args=_config(tmp_path, server, max_steps=1, num_generations=6, max_concurrent_harnesses=2),
    )
    trainer.train()
    assert int((tmp_path / "peak").read_text()) == 2  # a group alone would start 6


def test_an_sdk_agent_trains_the_model_with_the_usual_metrics(tmp_path, server):
    trainer = HarnessAsyncGRPOTrainer(
        model=MODEL, harness=sdk_agent, reward_funcs=accuracy_reward, train_dataset=_dataset(64),
        args=_config(tmp_path, server, max_steps=2),
    )
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    assert any(not torch.equal(before[n], p.detach()) for n, p in trainer.model.named_parameters())
    logs = _logged(trainer)
    assert len(logs) == 2
    keys = set().union(*logs)
    for name in ("loss", "reward", "num_tokens", "sampling/importance_sampling_ratio/mean",
                 "sample/staleness_max", "batch/packing_ratio", "rollout/fork_frac", "rollout/turns_mean",
                 "perf/weight_sync_s", "harness/calls_mean", "harness/failed_count", "harness/timeout_count",
                 "harness/no_call_count"):
        assert name in keys, f"{name} missing from {sorted(keys)}"
    assert all(entry["harness/failed_count"] == 0 and entry["harness/no_call_count"] == 0 for entry in logs)
    assert max(entry["rollout/turns_mean"] for entry in logs) == 2.0
    # the second call did not extend the first
    assert max(entry["rollout/fork_frac"] for entry in logs) == 1.0
    # the importance ratios stay near 1: the recorded log-probs are the sampler's for the trained tokens
    assert all(0.5 < entry["sampling/importance_sampling_ratio/mean"] < 2.0 for entry in logs)


@pytest.mark.slow
def test_raising_hanging_and_silent_harnesses_are_counted_not_fatal(tmp_path, server, capfd):
    trainer = HarnessAsyncGRPOTrainer(
        model=MODEL, harness=flaky_agent, train_dataset=_dataset(64),
        args=_config(tmp_path, server, max_steps=2, harness_timeout=1.0, max_concurrent_harnesses=4),
    )
    trainer.train()
    logs = _logged(trainer)
    assert len(logs) == 2
    totals = {name: sum(entry.get(name, 0) for entry in trainer.state.log_history)
              for name in ("harness/failed_count", "harness/timeout_count", "harness/no_call_count")}
    assert all(value > 0 for value in totals.values()), totals
    # each cause is told in a WARNING of the rollout process (its stderr), naming the harness
    err = capfd.readouterr().err
    warnings = [line for line in err.splitlines() if "WARNING" in line and "harness 'flaky_agent'" in line]
    for cause in ("raised RuntimeError: the agent crashed", "still running after harness_timeout=1 s",
                  "ended without calling the model"):
        assert any(cause in line for line in warnings), (cause, warnings[:5])


@pytest.mark.slow
def test_a_command_harness_trains(tmp_path, server):
    trainer = HarnessAsyncGRPOTrainer(
        model=MODEL, harness=HarnessCommand((sys.executable, str(AGENT))), train_dataset=_dataset(64),
        args=_config(tmp_path, server, max_steps=1, num_generations=2, max_concurrent_harnesses=4),
    )
    trainer.train()
    logs = _logged(trainer)
    assert len(logs) == 1 and logs[0]["harness/failed_count"] == 0


def test_truncated_sampling_and_bad_harnesses_are_refused_at_construction(tmp_path, server):
    with pytest.raises(ValueError, match="top_k=0"):
        HarnessAsyncGRPOTrainer(model=MODEL, harness=sdk_agent, train_dataset=_dataset(4),
                                args=_config(tmp_path, server, top_k=5))
    with pytest.raises(TypeError, match="harness must be"):
        HarnessAsyncGRPOTrainer(model=MODEL, harness=42, train_dataset=_dataset(4),
                                args=_config(tmp_path, server))
