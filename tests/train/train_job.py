"""The torchrun training script of the several-process tests (tests/train/test_multiprocess.py on
CPU, tests/gpu/test_fsdp_sync.py on GPUs): every rank trains the bundled tiny model on arithmetic for a
few steps against a running server, then writes what it saw to `<out>/rank<r>.json`.

    python -m torch.distributed.run --nproc_per_node N tests/train/train_job.py URL OUT [CONFIG_JSON]

URL may name several servers, comma-joined: the run trains against all of them and rank 0 checks each.

CONFIG_JSON overrides the AsyncGRPOConfig below (the short-run settings of test_trainer.py). It needs
only the package's runtime (no `datasets`, no math-verify): the dataset is a list of rows and the
reward the arithmetic task's own check.

With RECORD_FIRST_STEP=1 each rank also saves, to `<out>/first_step_rank<r>.pt`, the first step's
micro-batches (its samples, the global trained-token count, the loss) and the gradient the optimizer
is about to apply (after the data-parallel reduction), for a comparison with one process.
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing as mp
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import TrainerCallback

from asyncgrpo import AsyncGRPOConfig, AsyncGRPOTrainer
from asyncgrpo.generation.client import GenerationClient
from asyncgrpo.packing.tree import pack_row
from asyncgrpo.rewards.format import last_assistant_text
from asyncgrpo.rollout.channel import ROLLOUT_PROCESS_NAME
from asyncgrpo.sync.checksum import checksum_mismatches, weights_checksum
from asyncgrpo.tasks import arithmetic
from asyncgrpo.train.weights.gather import is_sharded, server_weight_metas, weights_for_server

MODEL = "asyncgrpo/tiny-chat"


def arithmetic_reward(completions: list, answer: list, **kwargs) -> list[float]:
    """1.0 for the right boxed integer, else 0.0."""
    return [float(arithmetic.is_correct(last_assistant_text(c), a)) for c, a in zip(completions, answer)]


def config(url: str, out: Path, overrides: dict) -> AsyncGRPOConfig:
    settings = {
        "output_dir": str(out / "out"), "vllm_server_base_url": url, "num_generations": 4,
        "max_completion_length": 32, "learning_rate": 1e-4, "bf16": False, "use_cpu": True,
        "gradient_checkpointing": False, "save_strategy": "no", "report_to": "none", "disable_tqdm": True,
        "logging_steps": 1, "seed": 0, "max_steps": 2,
    }
    return AsyncGRPOConfig(**{**settings, **overrides})


class WatchRollout(TrainerCallback):
    """Notes whether this process has the rollout process among its children."""

    def __init__(self) -> None:
        self.seen = False

    def on_step_end(self, args, state, control, **kwargs):
        self.seen = self.seen or any(p.name == ROLLOUT_PROCESS_NAME for p in mp.active_children())


class RecordingTrainer(AsyncGRPOTrainer):
    """Records, per micro-batch, this rank's row (what one process alone would count for it) and the
    global trained-token count it normalises by."""

    micro_batches: list
    first_step: list  # the first step's micro-batches: samples, global trained tokens, loss

    def training_step(self, model, inputs, num_items_in_batch=None):
        local = sum(int(sum(s.trained_mask)) for s in inputs.samples)
        row = pack_row(inputs.samples)
        self.micro_batches.append({
            "global": inputs.num_trained_tokens_global, "local": local, "step": self.state.global_step,
            "forwarded": row.num_tokens, "raw": row.num_raw_tokens, "samples": len(inputs.samples),
            "groups": sorted({s.group_id for s in inputs.samples}),
        })
        loss = super().training_step(model, inputs, num_items_in_batch)
        if self.state.global_step == 0:
            self.first_step.append({"samples": list(inputs.samples), "loss": float(loss),
                                    "global": inputs.num_trained_tokens_global})
        return loss


class SaveFirstGradient(TrainerCallback):
    """Saves the first step's micro-batches and the gradient the optimizer is about to apply."""

    def __init__(self, trainer: RecordingTrainer, path: Path) -> None:
        self.trainer, self.path = trainer, path

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        if state.global_step == 0:
            grads = {name: p.grad.detach().clone() for name, p in self.trainer.model.named_parameters()
                     if p.grad is not None}
            torch.save({"micro_batches": self.trainer.first_step, "grads": grads}, self.path)


class WatchAllowance(TrainerCallback):
    """Rank 0: the token allowance the trainer published after each step (added after the trainer's
    own callback, so it runs after the step's accounting)."""

    def __init__(self, trainer: AsyncGRPOTrainer) -> None:
        self.trainer = trainer
        self.after_step: list[int] = []

    def on_step_end(self, args, state, control, **kwargs):
        rollout = self.trainer._rollout
        channel = rollout.channel if rollout is not None else None
        if channel is not None:
            self.after_step.append(int(channel.token_allowance.value))


async def _served(url: str, what: str):
    async with GenerationClient(url, timeout_s=60) as client:
        if what == "dtype":
            return (await client.detect()).dtype
        return await client.weight_checksum(), await client.weight_info()


def make_trainer(url: str | list[str], out: Path, overrides: dict, callbacks=None) -> RecordingTrainer:
    """The job's trainer: the tiny model on arithmetic against `url`, with the settings of `config`."""
    trainer = RecordingTrainer(
        model=MODEL, reward_funcs=arithmetic_reward, train_dataset=arithmetic.make_dataset(64, seed=0),
        args=config(url, out, overrides), callbacks=callbacks,
    )
    trainer.micro_batches, trainer.first_step = [], []
    return trainer


def main(urls: list[str], out: Path, overrides: dict) -> None:
    url = urls[0]
    watch = WatchRollout()
    trainer = make_trainer(url if len(urls) == 1 else urls, out, overrides, callbacks=[watch])
    allowance = WatchAllowance(trainer)
    trainer.add_callback(allowance)
    if os.environ.get("RECORD_FIRST_STEP") == "1":
        trainer.add_callback(SaveFirstGradient(trainer, out / f"first_step_rank{dist.get_rank()}.pt"))
    dtype = getattr(torch, asyncio.run(_served(url, "dtype")))  # what the syncs send
    before = weights_checksum(weights_for_server(trainer.model, dtype))
    trainer.train()
    rank = dist.get_rank()
    after = weights_checksum(weights_for_server(trainer.model, dtype))  # sharded: every rank gathers
    syncs = [
        {k: v for k, v in e.items() if k.startswith("perf/weight_sync")} for e in trainer.state.log_history
    ]
    record = {
        "global_step": trainer.state.global_step, "micro_batches": trainer.micro_batches,
        "rollout_process_seen": watch.seen, "sharded": is_sharded(trainer.model), "weights": after,
        "syncs": [s for s in syncs if s], "allowance": allowance.after_step,
        "logs": [e for e in trainer.state.log_history if "batch/forwarded_tokens_per_step" in e],
    }
    if rank == 0:
        served, version = asyncio.run(_served(url, "checksum"))
        record["servers"] = []
        for other in urls:
            other_served, other_version = asyncio.run(_served(other, "checksum"))
            record["servers"].append({"url": other, "version": other_version,
                                      "checksum_mismatches": checksum_mismatches(after, other_served)})
        record.update(
            num_weights=len(after),
            checksum_mismatches=checksum_mismatches(after, served),
            server_version=version,
            changed=[n for n in after if after[n] != before[n]],
            dtype=str(dtype),
            sync_bytes=sum(m.nbytes for m in server_weight_metas(trainer.model, dtype)),
        )
    (out / f"rank{rank}.json").write_text(json.dumps(record))
    dist.barrier()


if __name__ == "__main__":
    main(sys.argv[1].split(","), Path(sys.argv[2]), json.loads(sys.argv[3]) if len(sys.argv) > 3 else {})
