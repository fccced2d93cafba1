"""AsyncGRPOTrainer on two processes (torchrun, gloo, CPU) against the embedded server.

This file is also the training script torchrun runs (`__main__`): every rank trains the bundled tiny
model for a few steps, then writes what it saw to `<out>/rank<r>.json`; the test reads both files.

On CPU the processes are data-parallel replicas (DDP): accelerate enables its FSDP plugin only on
accelerators, whatever `fsdp` says. The FSDP2 paths (DTensor gathers for the weight sync, the forward
through the sharded root, the gradient normalisation) run on CPU in tests/unit/test_sharded_weights.py
with `fully_shard` over gloo, and through the Trainer in tests/gpu/test_fsdp_sync.py.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from test_trainer import MODEL, _config, _dataset, server  # noqa: F401  (server: the module-scoped fixture)
from torchrun_job import run_torchrun

NUM_STEPS = 2


def test_two_processes_train_in_step_and_rank0_syncs_the_weights(tmp_path, server):  # noqa: F811
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    proc = run_torchrun([__file__, server.url, str(tmp_path)], nproc=2, env=env, timeout_s=240)
    assert proc.returncode == 0, f"torchrun failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]

    assert [r["global_step"] for r in ranks] == [NUM_STEPS, NUM_STEPS]
    assert len(ranks[0]["micro_batches"]) == len(ranks[1]["micro_batches"]) >= NUM_STEPS
    assert ranks[0]["rollout_process_seen"] and not ranks[1]["rollout_process_seen"]
    # every rank normalises by the trained tokens of both rows of the micro-batch
    for mine, theirs in zip(ranks[0]["micro_batches"], ranks[1]["micro_batches"]):
        assert mine["global"] == theirs["global"] == mine["local"] + theirs["local"]
    # after the last sync the server holds exactly the trainer's full (gathered) weights
    assert ranks[0]["server_version"] == f"step-{NUM_STEPS}"
    assert ranks[0]["num_weights"] > 0 and ranks[0]["checksum_mismatches"] == []
    assert ranks[0]["changed"], "no parameter moved"
    # the replicas' gradients were averaged: both ranks hold the same weights
    assert ranks[0]["weights"] == ranks[1]["weights"]


def _train(url: str, out: Path) -> None:
    """One rank of the torchrun job."""
    import asyncio
    import multiprocessing as mp
    from types import SimpleNamespace

    import torch
    import torch.distributed as dist
    from transformers import TrainerCallback

    from asyncgrpo import AsyncGRPOTrainer
    from asyncgrpo.generation.client import GenerationClient
    from asyncgrpo.rewards import accuracy_reward
    from asyncgrpo.rollout.channel import ROLLOUT_PROCESS_NAME
    from asyncgrpo.sync.checksum import checksum_mismatches, weights_checksum
    from asyncgrpo.train.model_setup import weights_for_server

    seen = {"rollout_process_seen": False, "micro_batches": []}

    class WatchRollout(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if any(p.name == ROLLOUT_PROCESS_NAME for p in mp.active_children()):
                seen["rollout_process_seen"] = True

    class RecordingTrainer(AsyncGRPOTrainer):
        def training_step(self, model, inputs, num_items_in_batch=None):
            local = sum(int(sum(s.trained_mask)) for s in inputs.samples)
            seen["micro_batches"].append({"global": inputs.num_trained_tokens_global, "local": local})
            return super().training_step(model, inputs, num_items_in_batch)

    config = _config(out, SimpleNamespace(url=url), max_steps=NUM_STEPS)
    trainer = RecordingTrainer(
        model=MODEL, reward_funcs=accuracy_reward, train_dataset=_dataset(64), args=config,
        callbacks=[WatchRollout()],
    )
    before = weights_checksum(weights_for_server(trainer.model, torch.float32))
    trainer.train()
    rank = dist.get_rank()
    after = weights_checksum(weights_for_server(trainer.model, torch.float32))
    record = {**seen, "global_step": trainer.state.global_step, "weights": after}
    if rank == 0:

        async def server_state():
            async with GenerationClient(url, timeout_s=60) as client:
                return await client.weight_checksum(), await client.weight_info()

        served, version = asyncio.run(server_state())
        record.update(
            num_weights=len(after), checksum_mismatches=checksum_mismatches(after, served), server_version=version,
            changed=[n for n in after if after[n] != before[n]],
        )
    (out / f"rank{rank}.json").write_text(json.dumps(record))
    dist.barrier()


if __name__ == "__main__":
    _train(sys.argv[1], Path(sys.argv[2]))
