"""bench/profile_step.py runs end to end on CPU (tiny shape), so that the GPU profile it is made for finds
it working."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench"


def test_training_step_profile_on_cpu(tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, str(BENCH / "profile_step.py"), "--device", "cpu", "--groups", "2",
                           "--out-dir", str(tmp_path)], check=False, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    result = json.loads((tmp_path / "profile_tiny_cpu.json").read_text())
    assert result["packing_ratio"] > 1 and result["wall_ms_per_step"] > 0
    assert abs(sum(result["categories_frac"].values()) - 1) < 1e-6 and result["categories_frac"]["matmul"] > 0
    assert set(result["phases_device_ms_per_step"]) == {"mask", "forward", "logprob_head", "backward"}
