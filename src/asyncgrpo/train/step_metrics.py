"""What the trainer logs: each optimizer step's totals over all processes, and the loss statistics.

    training_step --TrainerMetrics.add_micro_batch--> the step's StepTotals, the loss statistics merged
    on_step_end   --end_step----> the step's totals over all processes (the token allowance reads them)
                  --record_step-> batch/* and perf/* records in the metrics window
    Trainer.log   --logs--------> one flat dict: the window reduced (the rollout process's and the
                                  batcher's records included), num_tokens, the loss metrics

Every rank adds its micro-batches to a `StepTotals`; at the end of the step `across_processes`
gathers the counts of all ranks (one small object collective), so that `batch/*_per_step`,
`num_tokens` and the token allowance describe the whole step, not rank 0's share of it. Times are
the slowest rank's: it sets the pace of the step. The loss statistics are summed over the micro-batches
of every step since the last log and all-reduced over the processes when they are logged.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, fields

import torch
import torch.distributed as dist

from asyncgrpo import metrics as M
from asyncgrpo.metrics import MetricsWindow
from asyncgrpo.train.distributed import all_reduce_loss_stats, rank_and_world_size
from asyncgrpo.train.flops import FlopModel
from asyncgrpo.train.loss import LossStats, loss_metrics, merge_loss_stats
from asyncgrpo.train.rollout_batches import MicroBatchInput

__all__ = ["StepTotals", "TrainerMetrics"]


@dataclass
class StepTotals:
    """Sums over the micro-batches of one optimizer step, turned into batch/* and perf/* metrics."""

    started_at: float = field(default_factory=time.perf_counter)  # a step runs from the end of the last one
    optimizer_started: float = 0.0
    optimizer_s: float = 0.0
    wait_s: float = 0.0
    fwd_s: float = 0.0
    fwd_bwd_s: float = 0.0
    sync_barrier_s: float = 0.0  # the wait at the barrier that lines the processes up for a weight sync
    micro_batches: int = 0
    forwarded_tokens: int = 0
    raw_tokens: int = 0
    trained_tokens: int = 0
    trained_positions: int = 0
    attention_pairs: int = 0
    samples: int = 0
    groups: set[int] = field(default_factory=set)
    # the batcher's batch/* metrics, per micro-batch
    row_stats: list[dict[str, float]] = field(default_factory=list)

    def add_micro_batch(
        self, row, samples, row_stats: dict[str, float], *, fwd_s: float, fwd_bwd_s: float
    ) -> None:
        """Account one micro-batch of this process: its packed `row` of `samples`."""
        self.micro_batches += 1
        self.fwd_s += fwd_s
        self.fwd_bwd_s += fwd_bwd_s
        self.forwarded_tokens += int(row.input_ids.numel())
        self.raw_tokens += sum(len(s.token_ids) for s in samples)
        self.trained_tokens += int(row.target_ids.numel())
        # duplicated samples share their positions: a forwarded position is trained if any sample trains it
        self.trained_positions += int(torch.unique(row.pred_index).numel())
        self.attention_pairs += row.attention_pairs
        self.samples += len(samples)
        self.groups.update(s.group_id for s in samples)
        self.row_stats.append(row_stats)

    def across_processes(self) -> StepTotals:
        """The step's totals over all processes (every rank must call this, in step). Counts are
        summed, group ids united, times the slowest rank's; the batcher's row metrics already describe
        the whole micro-batch and are rank 0's."""
        _, world = rank_and_world_size()
        if world == 1:
            return self
        mine = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "row_stats"}
        every: list[dict] = [None] * world
        dist.all_gather_object(every, mine)
        total = StepTotals(started_at=self.started_at, optimizer_started=self.optimizer_started,
                           row_stats=self.row_stats)
        for name in ("forwarded_tokens", "raw_tokens", "trained_tokens", "trained_positions",
                     "attention_pairs", "samples"):
            setattr(total, name, sum(r[name] for r in every))
        for name in ("optimizer_s", "wait_s", "fwd_s", "fwd_bwd_s", "sync_barrier_s"):
            setattr(total, name, max(r[name] for r in every))
        total.micro_batches = self.micro_batches  # a micro-batch holds one row of every process
        total.groups = set().union(*(r["groups"] for r in every))
        return total

    def record_into(
        self,
        window: MetricsWindow,
        sync_s: dict[str, float],
        *,
        flop_model: FlopModel | None = None,
        peak_flops: float | None = None,
        num_processes: int = 1,
    ) -> None:
        """The step's batch/* and perf/* metrics (call on the totals `across_processes` returned).
        `perf/*_mfu` need a FLOP model and the device's peak FLOP/s (`asyncgrpo.train.flops`)."""
        step_s = time.perf_counter() - self.started_at
        r = window.record
        r(M.BATCH_FORWARDED_TOKENS_PER_STEP, self.forwarded_tokens)
        r(M.BATCH_TRAINED_TOKENS_PER_STEP, self.trained_tokens)
        r(M.BATCH_SAMPLES_PER_STEP, self.samples)
        r(M.BATCH_GROUPS_PER_STEP, len(self.groups))
        r(M.BATCH_MICROBATCHES_PER_STEP, self.micro_batches)
        if self.forwarded_tokens:
            r(M.BATCH_MASKED_TOKEN_FRAC, 1.0 - self.trained_positions / self.forwarded_tokens)
        for stats in self.row_stats:
            for name, value in stats.items():
                if name != M.BATCH_DROPPED_OVERSIZE_COUNT:  # counted where samples are taken
                    r(name, value)
        r(M.PERF_STEP_S, step_s)
        r(M.PERF_FWD_BWD_S, self.fwd_bwd_s)
        r(M.PERF_FWD_S, self.fwd_s)
        r(M.PERF_OPTIMIZER_S, self.optimizer_s)
        r(M.PERF_ROLLOUT_WAIT_S, self.wait_s)
        if self.fwd_bwd_s > 0:
            window.record_rate(M.PERF_FWD_BWD_FORWARDED_TOKENS_PER_S, self.forwarded_tokens, self.fwd_bwd_s)
        if step_s > 0:
            window.record_rate(M.PERF_WALL_CLOCK_FORWARDED_TOKENS_PER_S, self.forwarded_tokens, step_s)
            window.record_rate(M.PERF_WALL_CLOCK_TRAINED_TOKENS_PER_S, self.trained_tokens, step_s)
        if flop_model is not None and peak_flops:
            flops = flop_model.step_flops(self.forwarded_tokens, self.trained_tokens, self.attention_pairs)
            capacity = peak_flops * num_processes  # FLOP/s of every training device together
            if self.fwd_bwd_s > 0:
                window.record_ratio(M.PERF_FWD_BWD_MFU, flops, self.fwd_bwd_s * capacity)
            if step_s > 0:
                window.record_ratio(M.PERF_WALL_CLOCK_MFU, flops, step_s * capacity)
        if sync_s:  # the barrier before the push is part of the sync's time
            for key, seconds in sync_s.items():  # several servers: each one's part (`total_s/<i>`)
                prefix, _, index = key.partition("/")
                if prefix == "total_s" and index:
                    r(M.per_server(M.PERF_WEIGHT_SYNC_S, int(index)), seconds)
            r(M.PERF_WEIGHT_SYNC_S, sync_s["total_s"] + self.sync_barrier_s)
            r(M.PERF_WEIGHT_SYNC_PAUSE_S, sync_s["pause_s"])
            r(M.PERF_WEIGHT_SYNC_TRANSFER_S, sync_s["transfer_s"])
            r(M.PERF_WEIGHT_SYNC_BARRIER_S, self.sync_barrier_s)
            if "bytes" in sync_s:
                r(M.PERF_WEIGHT_SYNC_BYTES, sync_s["bytes"])
            if "delta" in sync_s:  # only a transport that may send a delta says whether it did
                r(M.PERF_WEIGHT_SYNC_DELTA_FRAC, sync_s["delta"])


class TrainerMetrics:
    """The trainer's metrics between two `Trainer.log` calls (every rank keeps one).

    Args:
        flop_model: The policy's FLOP model for perf/*_mfu (None: no MFU).
    """

    def __init__(self, flop_model: FlopModel | None) -> None:
        # the one sink: this module's records, the batcher's, the rollout process's
        self.window = MetricsWindow()
        self.step = StepTotals()  # the optimizer step in progress, this process's share
        self.flop_model = flop_model
        self.peak_flops: float | None = None  # the device's, known once train() has the training dtype
        self.loss_stats: LossStats | None = None  # summed since the last log, this process's
        self.num_tokens_forwarded = 0

    def add_micro_batch(
        self, row, inputs: MicroBatchInput, loss_stats: LossStats, *, fwd_s: float, fwd_bwd_s: float
    ) -> None:
        """Account one micro-batch of this process: its `inputs` packed as `row`, and its loss statistics."""
        self.step.add_micro_batch(row, inputs.samples, inputs.stats, fwd_s=fwd_s, fwd_bwd_s=fwd_bwd_s)
        self.loss_stats = (loss_stats if self.loss_stats is None
                           else merge_loss_stats(self.loss_stats, loss_stats))

    def end_step(self, *, skipped: bool, sync_barrier_s: float = 0.0) -> StepTotals:
        """The step's totals over all processes (every rank must call this, in step); the next step starts.
        `skipped`: the step had a non-finite loss or gradient and left the weights as they were.
        `sync_barrier_s`: this process's wait for the others before the step's weight sync (the longest
        wait of any process is logged: the time the earliest waited for the last)."""
        self.step.sync_barrier_s = sync_barrier_s
        totals, self.step = self.step.across_processes(), StepTotals()
        self.window.record(M.OPTIMIZER_NONFINITE_STEP_COUNT, int(skipped))
        return totals

    def record_step(self, totals: StepTotals, sync_s: dict[str, float], *, num_processes: int) -> None:
        """The step's batch/* and perf/* records (`sync_s`: the weight sync's timings, empty without one)."""
        totals.record_into(
            self.window, sync_s, flop_model=self.flop_model, peak_flops=self.peak_flops,
            num_processes=num_processes,
        )
        self.window.end_step()
        self.num_tokens_forwarded += totals.forwarded_tokens

    def logs(self, logs: dict[str, float]) -> dict[str, float]:
        """`logs` with the window reduced, num_tokens and the loss metrics since the last call (every rank
        must call this, in step: the loss statistics are all-reduced)."""
        # the Trainer's end-of-training summary (train_runtime, ...) is no window: no zero counts in it
        summary = "train_runtime" in logs
        window = self.window.reduce(fill_counts=not summary)
        logs = {**logs, **window, M.NUM_TOKENS: self.num_tokens_forwarded}
        if self.loss_stats is not None:
            logs.update(loss_metrics(all_reduce_loss_stats(self.loss_stats)))
            self.loss_stats = None
        return logs
