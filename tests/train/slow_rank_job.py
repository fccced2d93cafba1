"""The torchrun script of tests/train/test_weight_sync_barrier.py: two ranks train the tiny model for a
few steps, rank 1 arriving late at every step's end (it sleeps SLOW_S before the trainer's own step-end
work), and rank 0 writes the perf/weight_sync_* values it logged to `<out>/syncs.json`.

    python -m torch.distributed.run --nproc_per_node 2 tests/train/slow_rank_job.py URL OUT SLOW_S
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch.distributed as dist
from train_job import arithmetic_reward, config  # the several-process tests' settings (same folder)
from transformers import TrainerCallback

from asyncgrpo import AsyncGRPOTrainer
from asyncgrpo.tasks import arithmetic

MODEL = "asyncgrpo/tiny-chat"


class LateRank(TrainerCallback):
    """Rank 1 reaches the end of each step `seconds` late (user callbacks run before the trainer's)."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def on_step_end(self, args, state, control, **kwargs):
        if dist.get_rank() == 1:
            time.sleep(self.seconds)


def main(url: str, out: Path, slow_s: float) -> None:
    trainer = AsyncGRPOTrainer(
        model=MODEL, reward_funcs=arithmetic_reward, train_dataset=arithmetic.make_dataset(64, seed=0),
        args=config(url, out, {"max_steps": 2, "max_completion_length": 16}), callbacks=[LateRank(slow_s)],
    )
    trainer.train()
    if dist.get_rank() == 0:
        syncs = [
            {k: v for k, v in e.items() if k.startswith("perf/weight_sync")}
            for e in trainer.state.log_history if "perf/weight_sync_s" in e
        ]
        (out / "syncs.json").write_text(json.dumps(syncs))
    dist.barrier()


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]), float(sys.argv[3]))
