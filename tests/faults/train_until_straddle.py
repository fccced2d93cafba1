"""A trainer SIGKILLed right after a checkpoint taken while a group straddles two optimizer steps (some of
its samples trained, the rest not yet): run by test_resume_straddling_group.py.

    python tests/faults/train_until_straddle.py URL OUT_DIR

Every trained sample's prompt position is appended to OUT_DIR/trained_first.txt (flushed per micro-batch).
Exits 3 if the run ended without ever checkpointing a straddling group.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

from fault_helpers import MODEL, short_run_config, spread_reward
from transformers import TrainerCallback

from asyncgrpo import AsyncGRPOTrainer
from asyncgrpo.tasks import arithmetic

NUM_PROMPTS = 20


def straddle_config(out_dir, url: str):
    # a row holds fewer tokens than a group of 4 rollouts: groups spill into the next micro-batch, which
    # is the next optimizer step
    return short_run_config(out_dir, url, num_train_epochs=1, save_strategy="steps", save_steps=1,
                            token_budget=120, max_staleness=100, per_device_train_batch_size=1)


class Recording(AsyncGRPOTrainer):
    def training_step(self, model, inputs, num_items_in_batch=None):
        with self.record_path.open("a") as f:
            f.write("".join(f"{p}\n" for p in inputs.positions))
        return super().training_step(model, inputs, num_items_in_batch)


class KillAtStraddle(TrainerCallback):
    """After a checkpoint: if some prompt has samples trained but is not done, SIGKILL this process."""

    def __init__(self, trainer: Recording) -> None:
        self.trainer = trainer

    def on_save(self, args, state, control, **kwargs):
        trained = {int(line) for line in self.trainer.record_path.read_text().split()}
        saved = self.trainer._rollout_state()
        done_above = set(saved.trained_above)
        straddling = sorted(p for p in trained if p >= saved.trained_position and p not in done_above)
        if straddling:
            print(f"STRADDLING {straddling} at step {state.global_step}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)


if __name__ == "__main__":
    url, out = sys.argv[1], Path(sys.argv[2])
    trainer = Recording(
        model=MODEL, reward_funcs=spread_reward, train_dataset=arithmetic.make_dataset(NUM_PROMPTS, seed=2),
        args=straddle_config(out / "out", url),
    )
    trainer.record_path = out / "trained_first.txt"
    trainer.record_path.write_text("")
    trainer.add_callback(KillAtStraddle(trainer))
    trainer.train()
    sys.exit(3)
