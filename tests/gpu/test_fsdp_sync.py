"""Several GPUs: the embedded server on GPU 0, the trainer (torchrun, FSDP2, bf16) on the next GPUs,
weight sync over NCCL in the packed layout. Needs 2 CUDA devices (3 or more: two trainer ranks).

The server is `asyncgrpo serve asyncgrpo/tiny-chat --device cuda` with CUDA_VISIBLE_DEVICES=0. The
trainer is tests/train/train_job.py under torchrun with CUDA_VISIBLE_DEVICES=1 (or 1,2) and
`fsdp="full_shard", fsdp_config={"fsdp_version": 2}`: its parameters are DTensors, so every sync
gathers them on every rank and rank 0 broadcasts them to the server. After the run, the server's
weights must equal the trainer's gathered weights (sha256 of every tensor); the sync timings
(perf/weight_sync_*) and bandwidth are printed.

    NCCL_NVLS_ENABLE=0 pytest -m gpu -s tests/gpu/test_fsdp_sync.py
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

TRAIN = Path(__file__).resolve().parents[1] / "train"
from support.torchrun_job import run_torchrun

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(900, method="thread")]  # a hung NCCL call takes no signal

NUM_STEPS = 3
MODEL = "asyncgrpo/tiny-chat"


@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 CUDA devices"
)
def test_fsdp2_trainer_syncs_over_nccl_into_the_server_on_another_gpu(tmp_path):
    from asyncgrpo.launch import EmbeddedServer

    nproc = 2 if torch.cuda.device_count() >= 3 else 1
    trainer_gpus = ",".join(str(i) for i in range(1, 1 + nproc))
    no_multicast = {"NCCL_NVLS_ENABLE": "0"}
    overrides = {
        "max_steps": NUM_STEPS, "use_cpu": False, "bf16": True,
        "fsdp": "full_shard", "fsdp_config": {"fsdp_version": 2},
    }
    server_env = {"CUDA_VISIBLE_DEVICES": "0", **no_multicast}
    with EmbeddedServer(MODEL, device="cuda", env=server_env, log_path=tmp_path / "server.log",
                        startup_timeout_s=300) as server:
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "CUDA_VISIBLE_DEVICES": trainer_gpus, **no_multicast}
        script = str(TRAIN / "train_job.py")
        proc = run_torchrun([script, server.url, str(tmp_path), json.dumps(overrides)], nproc=nproc, env=env,
                            timeout_s=800)
    log = (tmp_path / "server.log").read_text()[-3000:]
    assert proc.returncode == 0, (
        f"torchrun failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}\nserver:\n{log}"
    )
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(nproc)]
    zero = ranks[0]

    print(f"\ntrainer ranks: {nproc} on GPU(s) {trainer_gpus}, server on GPU 0, {zero['dtype']}, "
          f"{zero['sync_bytes'] / 1e6:.2f} MB per sync")
    for i, sync in enumerate(zero["syncs"]):
        transfer = sync["perf/weight_sync_transfer_s"]
        print(f"  sync {i + 1}: perf/weight_sync_s {sync['perf/weight_sync_s']:.4f}  "
              f"pause {sync['perf/weight_sync_pause_s']:.4f}  transfer {transfer:.4f}  "
              f"{zero['sync_bytes'] / transfer / 1e9:.3f} GB/s")

    assert all(r["sharded"] for r in ranks), "the trainer's parameters are not DTensors: FSDP2 did not shard"
    assert [r["global_step"] for r in ranks] == [NUM_STEPS] * nproc
    assert len({len(r["micro_batches"]) for r in ranks}) == 1
    assert zero["rollout_process_seen"] and not any(r["rollout_process_seen"] for r in ranks[1:])
    for step in zip(*(r["micro_batches"] for r in ranks)):
        assert len({mb["global"] for mb in step}) == 1 and step[0]["global"] == sum(
            mb["local"] for mb in step
        )
    assert len(zero["syncs"]) == NUM_STEPS
    assert zero["server_version"] == f"v{NUM_STEPS}"
    assert zero["num_weights"] > 0 and zero["checksum_mismatches"] == []
    assert zero["changed"], "no parameter moved"
    assert all(r["weights"] == zero["weights"] for r in ranks)  # every rank gathered the same full weights
