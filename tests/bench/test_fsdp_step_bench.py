"""bench/fsdp_step.py runs on CPU: two gloo ranks shard the tiny shape with FSDP2, train two steps, and
their step loss equals the one-process loss of the same rows."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from support.torchrun_job import run_torchrun

pytestmark = pytest.mark.process

BENCH = Path(__file__).resolve().parents[2] / "bench" / "fsdp_step.py"


@pytest.mark.slow
def test_fsdp_step_bench_smoke_on_two_cpu_ranks(tmp_path):
    out = tmp_path / "fsdp_step.json"
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    proc = run_torchrun([str(BENCH), "--device", "cpu", "--out", str(out)], nproc=2, env=env, timeout_s=240)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    (result,) = json.loads(out.read_text())["results"]
    assert result["ranks"] == 2 and [r["rank"] for r in result["per_rank"]] == [0, 1]
    assert all(r["tokens_per_s"] > 0 for r in result["per_rank"])
    assert result["loss_match"] and result["loss_step0"] != 0.0
