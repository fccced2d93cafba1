"""bench/one_gpu.py end to end on CPU (`--shape tiny`): the same script the H200 runs, so that the one
GPU run finds it working. Both settings train against one embedded server, and the JSON holds what
the GPU run reports."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.process

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.mark.slow  # ~45 s: a server start and two training runs (start-up, 1 warm-up step, 6 s measured)
def test_one_gpu_bench_runs_both_settings_on_cpu(tmp_path):
    out = tmp_path / "one_gpu.json"
    cmd = [sys.executable, str(BENCH / "one_gpu.py"), "--shape", "tiny", "--device", "cpu",
           "--max-seconds", "6", "--warmup-steps", "1", "--work-dir", str(tmp_path / "work"),
           "--output", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, check=False,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    assert "[tiny async #0] step 1 " in proc.stdout  # progress, one line per step

    result = json.loads(out.read_text())
    assert result["status"] == "done" and result["command"].startswith("python ")
    tiny = result["shapes"]["tiny"]
    assert 20 <= tiny["prompt_tokens_mean"] <= 28  # the preset asks for 24
    runs = {r["setting"]: r for r in tiny["runs"]}
    assert set(runs) == {"async", "on_policy"} and [r["max_staleness"] for r in tiny["runs"]] == [4, 0]
    for run in runs.values():
        assert run["status"] == "done" and run["stopped_by_time"]
        # CPU trainer; on one GPU: IpcTransport(embedded)
        assert run["transport"] == "CollectiveTransport(gloo)"
        summary = run["summary"]
        assert summary["steady_steps"] >= 2
        assert summary["trained_tokens_per_s"] > 0 and summary["generated_tokens_per_s"] > 0
        assert 0 < summary["rollout_cpu_s_per_generated_token"] < 0.1
        assert summary["mean_perf/weight_sync_s"] > 0 and "mean_perf/fwd_bwd_s" in summary
        assert summary["mean_frac_reward_zero_std"] < 0.5  # the reward varies within groups
        assert run["steps"][-1]["step"] == len(run["steps"])
        # the server's counter is read off the trainer's path, and each step gets its value at its own time
        assert run["metrics_read_s"]["reads"] >= 2
        # one-token completions sent through the run come back, and say how long they took
        assert run["round_trip_s"]["probes"] >= 2 and run["round_trip_s"]["failures"] == 0
        assert 0 < run["round_trip_s"]["median"] <= run["round_trip_s"]["max"]
        # CPU: no graphs
        assert run["server_graphs"] == {"graph_captures": 0, "graph_capture_seconds": 0.0,
                                        "graph_captures_deferred": 0}
        counts = [s["generated_tokens"] for s in run["steps"]]
        assert None not in counts and counts == sorted(counts)
    comparison = tiny["comparison"]
    assert comparison["async_over_on_policy"]["trained_tokens_per_s"] > 0
    assert set(comparison["targets"]) >= {"weight_sync_s", "weight_sync_s_at_most_0.1"}
