"""bench/profile_step.py runs end to end on CPU (tiny shape, the outermost aten ops standing in for
kernels), so that the GPU profile it is made for finds its attribution working."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.process

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.mark.slow
def test_training_step_profile_on_cpu_adds_up_to_the_wall_time(tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, str(BENCH / "profile_step.py"), "--device", "cpu", "--groups", "3",
                           "--workload", "shared-prompt", "--variants", "base", "head",
                           "--out-dir", str(tmp_path)], check=False,
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    for variant in ("base", "head"):
        result = json.loads((tmp_path / f"profile_shared-prompt_tiny_{variant}_cpu.json").read_text())
        assert result["packing_ratio"] > 2
        ms, wall = result["categories_ms_per_step"], result["wall_ms_per_step"]
        # exclusive categories: busy time plus idle is the wall time, never more
        assert abs(sum(ms.values()) - wall) < 1e-6 * wall and result["device_busy_ms_per_step"] <= wall
        for category in ("mask", "logprob_head", "recompute", "attention_fwd", "attention_bwd", "matmul",
                         "elementwise"):
            assert ms[category] > 0, f"{variant}: nothing attributed to {category}: {ms}"
        phases = result["phases_device_ms_per_step"]
        assert phases["recompute"]["matmul"] > 0 and phases["recompute"]["attention"] > 0
        assert phases["backward"]["attention"] == ms["attention_bwd"]
        assert set(result["phases_host_ms_per_step"]) == {"mask", "forward", "logprob_head",
                                                          "recompute", "backward"}
