"""A trainer that runs until it is killed (the script of tests/faults/test_parent_death.py).

    python tests/faults/train_until_killed.py URL OUT_DIR

After its first optimizer step it writes `OUT_DIR/ready` (its pid), then keeps training.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from fault_helpers import MODEL, short_run_config, spread_reward
from transformers import TrainerCallback

from asyncgrpo import AsyncGRPOTrainer
from asyncgrpo.tasks import arithmetic


class SayReady(TrainerCallback):
    def __init__(self, path: Path) -> None:
        self.path = path

    def on_step_end(self, args, state, control, **kwargs):
        if not self.path.exists():
            self.path.write_text(str(os.getpid()))


if __name__ == "__main__":
    url, out = sys.argv[1], Path(sys.argv[2])
    trainer = AsyncGRPOTrainer(
        model=MODEL, reward_funcs=spread_reward, train_dataset=arithmetic.make_dataset(64, seed=0),
        args=short_run_config(out / "out", url, max_steps=100_000), callbacks=[SayReady(out / "ready")],
    )
    trainer.train()
