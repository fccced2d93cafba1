"""perf/weight_sync_barrier_s measures the time the processes wait for each other at a weight sync:
two ranks (torchrun, gloo, CPU) against the embedded server, one of them late at every step's end."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from support.torchrun_job import run_torchrun

pytestmark = pytest.mark.process

JOB = Path(__file__).with_name("slow_rank_job.py")
SLOW_S = 2.0


@pytest.fixture
def server(embedded_server):
    return embedded_server("asyncgrpo/tiny-chat", purpose="trained")  # the ranks push weights into it


@pytest.mark.slow
def test_the_barrier_time_is_the_wait_for_a_late_rank(tmp_path, server):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    proc = run_torchrun([str(JOB), server.url, str(tmp_path), str(SLOW_S)], nproc=2, env=env, timeout_s=300)
    assert proc.returncode == 0, f"torchrun failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    syncs = json.loads((tmp_path / "syncs.json").read_text())
    assert len(syncs) == 2, syncs
    for sync in syncs:
        barrier = sync["perf/weight_sync_barrier_s"]
        assert 0.75 * SLOW_S <= barrier <= SLOW_S + 5.0, sync  # rank 0 waited for rank 1's late arrival
        # the sync's time holds its parts
        parts = sync["perf/weight_sync_pause_s"] + barrier + sync["perf/weight_sync_transfer_s"]
        assert sync["perf/weight_sync_s"] >= parts - 1e-3, sync
