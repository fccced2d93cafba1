"""examples/harness_openai.py runs end to end: its `main()` for 2 steps on the bundled tiny model (CPU),
with its own embedded server; the agent's tool-call round trips reach the recorded turns."""

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
    monkeypatch.delitem(sys.modules, "harness_openai", raising=False)
    return importlib.import_module("harness_openai")


def test_the_openai_agent_trains_with_its_tool_calls(example, tmp_path):
    history = example.main(["--max-steps", "2", "--output-dir", str(tmp_path)])
    steps = [entry for entry in history if "perf/step_s" in entry]
    assert len(steps) == 2
    keys = set().union(*steps)
    assert {"reward", "harness/calls_mean", "harness/failed_count", "rollout/turns_mean"} <= keys
    # the agent sent tool results back: rollouts have several model calls, joined into training sequences
    assert max(entry["rollout/turns_mean"] for entry in steps) > 1.0
    assert all(entry["harness/failed_count"] == 0 and entry["harness/timeout_count"] == 0 for entry in steps)
