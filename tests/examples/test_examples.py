"""The examples run end to end: each example's `main()` for 2 steps on the bundled tiny model (CPU).

An example is imported as a module from examples/ (the spawned rollout process imports it the same
way, to unpickle the tools, environments and reward functions it defines) and runs with its own
embedded server.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

from asyncgrpo.modeling.load import resolve_model_path

pytestmark = pytest.mark.process

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@pytest.fixture
def example(monkeypatch):
    try:
        resolve_model_path("asyncgrpo/tiny-chat")
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    monkeypatch.syspath_prepend(str(EXAMPLES))  # spawned children inherit sys.path

    def load(name: str):
        monkeypatch.delitem(sys.modules, name, raising=False)
        return importlib.import_module(name)

    return load


def _steps(log_history: list[dict]) -> list[dict]:
    return [entry for entry in log_history if "perf/step_s" in entry]


@pytest.mark.slow
def test_multi_env_routes_rows_to_both_environments(example, tmp_path):
    steps = _steps(example("multi_env").main(["--max-steps", "2", "--output-dir", str(tmp_path)]))
    assert len(steps) == 2
    keys = set().union(*steps)
    assert "tools/increment/call_count" in keys  # counter rows ran in the counter environment
    assert "env/reset_s" in keys


@pytest.mark.slow
def test_tools_example_runs_its_plain_tools(example, tmp_path):
    steps = _steps(example("tools").main(["--max-steps", "2", "--output-dir", str(tmp_path)]))
    assert len(steps) == 2
    keys = set().union(*steps)
    assert "tools/increment/call_count" in keys and "rewards/reached_target/mean" in keys
    assert "rewards/tool_error_penalty/mean" in keys


def test_a_plain_async_tool_keeps_one_counter_per_rollout(example):
    """The example's `increment` relies on each rollout running as its own asyncio task."""
    import asyncio

    tools = example("tools")

    async def rollout(steps: list[int]) -> list[int]:
        return [await tools.increment(s) for s in steps]

    async def both():
        return await asyncio.gather(rollout([3, 4, 5]), rollout([1, 1]))

    assert asyncio.run(both()) == [[3, 7, 12], [1, 2]]
    messages = [{"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "increment", "arguments": {"step": 4}}}]},
        {"role": "tool", "name": "increment", "content": "4"},
        {"role": "assistant", "content": "The counter is at 4."}]
    assert tools.reached_target([messages, messages], target=[4, 5], max_step=[4, 4]) == [1.0, 0.0]
    assert tools.reached_target([messages], target=[4], max_step=[3]) == [0.0]  # a step above the limit


@pytest.mark.slow  # ~30 s: a server start, two held-out evaluations and two steps on CPU
def test_real_model_recipe_runs_and_reports_held_out_accuracy(example, tmp_path):
    real_model = example("real_model")
    result = real_model.main(["--device", "cpu", "--model", "asyncgrpo/tiny-chat", "--max-steps", "2",
                              "--eval-prompts", "8", "--eval-samples", "1", "--token-budget", "1024",
                              "--grad-accum", "1", "--num-train-prompts", "64",
                              "--output-dir", str(tmp_path)])
    assert result["steps"] == 2 and 0 <= result["accuracy_before"] <= 1 and 0 <= result["accuracy_after"] <= 1
    assert (tmp_path / "result.json").exists()


@pytest.mark.slow
def test_the_openai_agent_trains_with_its_tool_calls(example, tmp_path):
    steps = _steps(example("harness_openai").main(["--max-steps", "2", "--output-dir", str(tmp_path)]))
    assert len(steps) == 2
    keys = set().union(*steps)
    assert {"reward", "harness/calls_mean", "harness/failed_count", "rollout/turns_mean"} <= keys
    # the agent sent tool results back: rollouts have several model calls, joined into training sequences
    assert max(entry["rollout/turns_mean"] for entry in steps) > 1.0
    assert all(entry["harness/failed_count"] == 0 and entry["harness/timeout_count"] == 0 for entry in steps)
