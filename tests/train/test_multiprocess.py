"""AsyncGRPOTrainer on two processes (torchrun, gloo, CPU) against the embedded server.

The ranks run tests/train/train_job.py, which trains the bundled tiny model for a few steps and
writes what each rank saw; the test reads both files.

On CPU the processes are data-parallel replicas (DDP): accelerate enables its FSDP plugin only on
accelerators, whatever `fsdp` says. The FSDP2 paths (DTensor gathers for the weight sync, the forward
through the sharded root, the gradient normalisation) run on CPU in
tests/train/weights/test_sharded_weights.py with `fully_shard` over gloo, and through the Trainer in
tests/gpu/test_fsdp_sync.py.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from support.torchrun_job import run_torchrun

pytestmark = pytest.mark.process

JOB = Path(__file__).with_name("train_job.py")
NUM_STEPS = 2


@pytest.fixture
def server(embedded_server):
    """The server tests/train/test_trainer.py trains against (the pool's, for tests that push weights)."""
    return embedded_server("asyncgrpo/tiny-chat", purpose="trained")


@pytest.mark.slow
def test_two_processes_train_in_step_and_rank0_syncs_the_weights(tmp_path, server):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    config = {"max_steps": NUM_STEPS}
    proc = run_torchrun(
        [str(JOB), server.url, str(tmp_path), json.dumps(config)], nproc=2, env=env, timeout_s=240
    )
    assert proc.returncode == 0, f"torchrun failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]

    assert [r["global_step"] for r in ranks] == [NUM_STEPS, NUM_STEPS]
    assert len(ranks[0]["micro_batches"]) == len(ranks[1]["micro_batches"]) >= NUM_STEPS
    assert ranks[0]["rollout_process_seen"] and not ranks[1]["rollout_process_seen"]
    # every rank normalises by the trained tokens of both rows of the micro-batch
    for mine, theirs in zip(ranks[0]["micro_batches"], ranks[1]["micro_batches"]):
        assert mine["global"] == theirs["global"] == mine["local"] + theirs["local"]
    # after the last sync the server holds exactly the trainer's weights
    assert ranks[0]["server_version"] == f"v{NUM_STEPS}" and len(ranks[0]["syncs"]) == NUM_STEPS
    assert ranks[0]["num_weights"] > 0 and ranks[0]["checksum_mismatches"] == []
    assert ranks[0]["changed"], "no parameter moved"
    # the replicas' gradients were averaged: both ranks hold the same weights
    assert not ranks[0]["sharded"] and ranks[0]["weights"] == ranks[1]["weights"]


def step_sums(ranks: list[dict], step: int) -> dict:
    """What one process training every row of `step` would count: sums over both ranks' rows."""
    rows = [m for r in ranks for m in r["micro_batches"] if m["step"] == step]
    return {
        "forwarded": sum(m["forwarded"] for m in rows), "raw": sum(m["raw"] for m in rows),
        "trained": sum(m["local"] for m in rows), "samples": sum(m["samples"] for m in rows),
        "groups": len({g for m in rows for g in m["groups"]}),
    }


@pytest.mark.slow
def test_step_metrics_and_token_allowance_count_every_process(tmp_path, server):
    """batch/*_per_step, num_tokens and the allowance are sums over both ranks' rows (not rank 0's x 2)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    config = {"max_steps": NUM_STEPS, "max_staleness": 2}
    proc = run_torchrun(
        [str(JOB), server.url, str(tmp_path), json.dumps(config)], nproc=2, env=env, timeout_s=240
    )
    assert proc.returncode == 0, f"torchrun failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    logs = ranks[0]["logs"]
    assert len(logs) == NUM_STEPS and len(ranks[0]["allowance"]) == NUM_STEPS
    num_tokens = 0
    for step, log in enumerate(logs):
        want = step_sums(ranks, step)
        assert want["raw"] > 0
        assert log["batch/forwarded_tokens_per_step"] == want["forwarded"]
        assert log["batch/trained_tokens_per_step"] == want["trained"]
        assert log["batch/samples_per_step"] == want["samples"]
        assert log["batch/groups_per_step"] == want["groups"]
        num_tokens += want["forwarded"]
        assert log["num_tokens"] == num_tokens
        # max_staleness steps' worth of the tokens the whole step consumed
        assert ranks[0]["allowance"][step] == 2 * want["raw"]
