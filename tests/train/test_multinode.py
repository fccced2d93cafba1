"""AsyncGRPOTrainer across two torchrun "nodes" (`--nnodes 2 --node_rank 0/1`, one process each, gloo,
CPU) on this machine, against two embedded servers: what a multi-node launch does on separate hosts.

Each node's only process has LOCAL_RANK 0, so this is where code that took the local main process for the
global one would show: the rollout process must run on global rank 0 alone, and rank 0 alone pushes the
weights, into both servers.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from support.torchrun_job import run_torchrun_nodes

pytestmark = [pytest.mark.process, pytest.mark.slow]

JOB = Path(__file__).with_name("train_job.py")
NUM_STEPS = 2


@pytest.mark.timeout(400)
def test_two_nodes_train_in_step_against_two_servers_and_rank0_syncs_both(tmp_path, embedded_server):
    servers = [embedded_server("asyncgrpo/tiny-chat", purpose=f"node server {i}") for i in (0, 1)]
    urls = ",".join(server.url for server in servers)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    nodes = run_torchrun_nodes([str(JOB), urls, str(tmp_path), json.dumps({"max_steps": NUM_STEPS})],
                               nnodes=2, nproc=1, env=env, timeout_s=300)
    for node, proc in enumerate(nodes):
        assert proc.returncode == 0, f"node {node} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-5000:]}"
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]

    assert [r["global_step"] for r in ranks] == [NUM_STEPS, NUM_STEPS]
    assert ranks[0]["rollout_process_seen"] and not ranks[1]["rollout_process_seen"]
    # each rank normalises by the trained tokens of both nodes' rows
    for mine, theirs in zip(ranks[0]["micro_batches"], ranks[1]["micro_batches"]):
        assert mine["global"] == theirs["global"] == mine["local"] + theirs["local"]
    # both nodes hold the same weights, and after the last sync both servers serve exactly them
    assert ranks[0]["changed"] and ranks[0]["weights"] == ranks[1]["weights"]
    assert [s["version"] for s in ranks[0]["servers"]] == [f"v{NUM_STEPS}"] * 2
    assert [s["checksum_mismatches"] for s in ranks[0]["servers"]] == [[], []]
    assert {f"perf/weight_sync_s/{i}" for i in (0, 1)} <= set().union(*ranks[0]["syncs"])
