"""AsyncGRPOTrainer across two torchrun "nodes" (`--nnodes 2 --node_rank 0/1`, one process each, gloo,
CPU) on this machine, against two embedded servers: what a multi-node launch does on separate hosts.
The first step's loss and gradient equal one process's training on both nodes' samples.

Each node's only process has LOCAL_RANK 0, so this is where code that took the local main process for the
global one would show: the rollout process must run on global rank 0 alone, and rank 0 alone pushes the
weights, into both servers.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch
from support.torchrun_job import run_torchrun_nodes

from asyncgrpo.train.rollout_batches import MicroBatchInput

pytestmark = [pytest.mark.process, pytest.mark.slow]

JOB = Path(__file__).with_name("train_job.py")
NUM_STEPS = 2


@pytest.mark.timeout(400)
def test_two_nodes_train_in_step_against_two_servers_and_rank0_syncs_both(tmp_path, embedded_server):
    servers = [embedded_server("asyncgrpo/tiny-chat", purpose=f"node server {i}") for i in (0, 1)]
    urls = ",".join(server.url for server in servers)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1",
           "RECORD_FIRST_STEP": "1"}
    overrides = {"max_steps": NUM_STEPS, "max_grad_norm": 0.0}  # the gradient as computed, unclipped
    nodes = run_torchrun_nodes([str(JOB), urls, str(tmp_path), json.dumps(overrides)],
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

    # the first step, as one process would train it: both nodes' samples in one row, normalised by the
    # same global token count; its loss is the sum of the nodes' and its gradient the reduced one
    first = [torch.load(tmp_path / f"first_step_rank{r}.pt", weights_only=False) for r in (0, 1)]
    assert first[0]["grads"].keys() == first[1]["grads"].keys()
    for name, grad in first[0]["grads"].items():
        torch.testing.assert_close(grad, first[1]["grads"][name], atol=0, rtol=0)
    one = one_process_trainer(urls.split(",")[0], tmp_path, overrides)
    (mine,), (theirs,) = first[0]["micro_batches"], first[1]["micro_batches"]
    assert mine["global"] == theirs["global"]
    loss = one.training_step(one.model, MicroBatchInput(samples=mine["samples"] + theirs["samples"],
                                                        num_trained_tokens_global=mine["global"]))
    assert float(loss) == pytest.approx(mine["loss"] + theirs["loss"], rel=1e-5, abs=1e-7)
    grads = {name: p.grad for name, p in one.model.named_parameters() if p.grad is not None}
    assert grads.keys() == first[0]["grads"].keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, first[0]["grads"][name], atol=2e-6, rtol=1e-4, msg=name)


def one_process_trainer(url: str, out: Path, overrides: dict):
    """train_job.py's trainer in this process (world size 1), untrained."""
    sys.path.insert(0, str(JOB.parent))
    import train_job

    trainer = train_job.make_trainer(url, out / "one", overrides)
    trainer.model.zero_grad(set_to_none=True)
    return trainer
