"""The trainer's input: scored samples from the rollout queue -> micro-batches of packed rows.

    channel.samples --take--> drop stale --> TokenBudgetBatcher --> micro-batch (one row per process)
          ^                                                              |
          |  waits (perf/rollout_wait_s) only when the queue is empty    v
          |  and checks the rollout process's health every poll     rank 0 scatters rows, every rank
          |                                                          packs its row and trains on it

Rank 0 owns the queue; with several processes it sends each rank its row (one object collective per
micro-batch), so the batcher's cross-row balancing is the only place that decides who trains what.

A partially filled micro-batch is closed when more samples cannot come before the trainer acts:
- a `RolloutIdle` arrives whose trainer view still equals the current one: the rollout process has no
  group in flight and waits on the staleness limit (which counts these very samples) or, with
  `max_staleness=0`, on the next weight version. An outdated one (the trainer consumed or stepped
  since) is ignored: the rollout process sends a fresh one if it is still blocked.
- the rollout process ran out of prompts (a final `RolloutIdle`), or the last prompt of the run is
  accounted for: what is left is trained and the iteration ends.

With `max_staleness=0` the rollout process generates about one step's worth of tokens per weight
version and then waits for the next one. When the trainer runs out before the version changes (more
micro-batches of a step under gradient accumulation, another step before the next weight sync, or
groups dropped for zero reward std), an on-policy `RolloutIdle` finds nothing to close: the trainer
then raises `token_allowance` by one micro-batch's worth, which lets the rollout process go on under
the same version. Without that, each side would wait on the other.
A run whose rollout process keeps finishing groups that are all dropped (a reward that is NaN or constant
for every completion, every prompt filtered, every sample stale or too long) would wait forever with a
busy server: after `no_sample_timeout_s` (`rollout_worker_timeout`) of waiting with drops and no trainable
sample, the trainer raises an error that counts the drops by cause (`DropTally`). A rollout process that
drops nothing is only slow (each request is bounded by the server timeout), and its wait is only noticed.

There is no flush on a timer: the rollout process is either producing (rollouts in flight, each bounded
by the server timeout; closing early would only shrink the step), idle (and says so), or failed, which
`check_health` turns into an error at the next poll.
"""

from __future__ import annotations

import logging
import queue as queue_lib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist

from asyncgrpo import metrics as M
from asyncgrpo.rollout.admission import is_stale, on_policy_extension, staleness
from asyncgrpo.rollout.channel import IDLE_ON_POLICY, GroupFinished, QueuedSample, RolloutIdle
from asyncgrpo.train.distributed import rank_and_world_size
from asyncgrpo.train.progress import TrainedPrompts
from asyncgrpo.types import WeightVersion

logger = logging.getLogger(__name__)

# samples dropped as longer than the token budget, none taken before them, after which the run stops
OVERSIZE_LIMIT = 64


@dataclass
class DropTally:
    """What was dropped since the last trainable sample, by cause (what a run that trains nothing says)."""

    unscored_groups: int = 0  # every reward None or NaN: fewer than two scored rollouts
    equal_reward_groups: int = 0  # zero reward std
    filtered_prompts: int = 0  # rejected by filter_prompt (a marker without records)
    stale_samples: int = 0
    oversize_samples: int = 0
    last_equal_reward: float = float("nan")

    @property
    def any_dropped(self) -> bool:
        """Something generated was dropped (prompts filtered or skipped on resume alone do not count: the
        rollout process fails by itself when it rejects a whole epoch)."""
        dropped = self.unscored_groups + self.equal_reward_groups + self.stale_samples + self.oversize_samples
        return dropped > 0

    def add_dropped_group(self, records: tuple) -> None:
        """A prompt that produced no sample, from its `GroupFinished` records (`scoring.reward_records`)."""
        names = [M.MetricRecord(*r).name for r in records]
        if M.FRAC_REWARD_ZERO_STD not in names:
            self.filtered_prompts += 1
            return
        rewards = [M.MetricRecord(*r).value for r in records if M.MetricRecord(*r).name == M.REWARD]
        if len(rewards) < 2:
            self.unscored_groups += 1
        else:
            self.equal_reward_groups += 1
            self.last_equal_reward = rewards[0]

    def describe(self, *, max_staleness: int, token_budget: int) -> str:
        """The counts and, for each cause, what to change."""
        parts = []
        if self.unscored_groups:
            parts.append(
                f"{self.unscored_groups} groups with no scored rollout, or only one (rewards None or NaN): "
                "make the reward functions return a float for these prompts"
            )
        if self.equal_reward_groups:
            parts.append(
                f"{self.equal_reward_groups} groups with equal rewards (the latest: reward "
                f"{self.last_equal_reward:g}): the reward must tell completions apart, on prompts the model "
                "solves sometimes (frac_reward_zero_std)"
            )
        if self.filtered_prompts:
            parts.append(
                f"{self.filtered_prompts} prompts rejected by filter_prompt (or trained before a resume)"
            )
        if self.stale_samples:
            parts.append(
                f"{self.stale_samples} samples dropped as stale (older than max_staleness={max_staleness} "
                "weight versions): raise max_staleness"
            )
        if self.oversize_samples:
            parts.append(
                f"{self.oversize_samples} samples longer than token_budget={token_budget}: raise "
                "token_budget or lower max_completion_length"
            )
        return "; ".join(parts)


@dataclass
class MicroBatchInput:
    """What `training_step` receives: this rank's samples and the micro-batch totals."""

    samples: list[Any]
    num_trained_tokens_global: int
    stats: dict[str, float] = field(default_factory=dict)
    positions: list[int] = field(default_factory=list)


class RolloutBatches:
    """Iterable of `MicroBatchInput`s, one per micro-batch, for this rank."""

    def __init__(
        self,
        *,
        channel: Any,
        batcher: Any,
        progress: TrainedPrompts,
        check_health: Callable[[], None],
        current_version: Callable[[], WeightVersion],
        record: Callable[[str, float], None],
        add_record: Callable[[Any], None],
        max_staleness: int,
        token_budget: int,
        total_positions: int | None,
        poll_s: float = 0.5,
        no_sample_timeout_s: float | None = None,
        resumed_samples: list[QueuedSample] = (),
    ) -> None:
        self.channel = channel
        self.batcher = batcher
        self.progress = progress
        self.check_health = check_health
        self.current_version = current_version
        self.record = record
        self.add_record = add_record  # a group's own records (MetricRecord), from its GroupFinished marker
        self.max_staleness = max_staleness
        self.token_budget = token_budget
        self._warned_oversize = False
        self._oversize: list[int] = []  # lengths of the samples dropped as too long before any was taken
        self._took_any = False
        self.total_positions = total_positions
        self.poll_s = poll_s  # how often an empty queue wait checks the rollout process's health
        # the longest wait with drops and no trainable sample (None: forever)
        self.no_sample_timeout_s = no_sample_timeout_s
        self._drops = DropTally()  # since the last trainable sample
        self._last_trainable = time.monotonic()
        self.wait_s = 0.0  # time the trainer waited on an empty queue since the last `pop_wait_s`
        self._ready: list[Any] = []  # closed micro-batches not yet handed out
        self._meta: dict[int, QueuedSample] = {}  # id(sample) -> its queue item, while in the batcher
        self._markers_seen = 0
        self._markers_in_run = 0
        self._start_position = progress.trained_position
        self._empty_markers = 0
        self.notice_after_s = 30.0
        self._out_of_prompts = False  # the rollout process sent its final RolloutIdle
        self._finished = False
        # a resumed run: the untrained samples of prompts partly trained at the checkpoint come first, with
        # their markers; the rollout process skips those prompts (its empty markers for them are ignored)
        self._resumed_positions: set[int] = set()
        self._resumed_items: list[Any] = _with_markers(list(resumed_samples))

    # -- rank 0: the queue side -------------------------------------------------------------------

    def pop_wait_s(self) -> float:
        wait, self.wait_s = self.wait_s, 0.0
        return wait

    def _take(self, item: Any) -> None:
        if isinstance(item, RolloutIdle):
            self._on_idle(item)
            return
        if isinstance(item, GroupFinished) and item.position in self._resumed_positions:
            self._resumed_positions.discard(item.position)  # the rollout process skipped it: taken already
            return
        if isinstance(item, GroupFinished):
            for record in item.records:
                self.add_record(record)
            self._markers_seen += 1
            self._empty_markers += item.num_samples == 0
            if item.num_samples == 0:
                self._drops.add_dropped_group(item.records)
            self.progress.on_group_finished(item.position, item.num_samples)
            if self.total_positions is None or item.position < self.total_positions:
                self._markers_in_run += 1
            return
        assert isinstance(item, QueuedSample), f"unexpected item in the rollout queue: {type(item).__name__}"
        if self.total_positions is not None and item.position >= self.total_positions:
            self._consume([item])  # generated past the last epoch: not part of this run
            return
        version = self.current_version()
        behind = staleness(item.sample.model_version, version)
        self.record(M.SAMPLE_STALENESS_MEAN, behind)
        self.record(M.SAMPLE_STALENESS_MAX, behind)
        if is_stale(item.sample.model_version, version, self.max_staleness):
            self.record(M.SAMPLE_DROPPED_STALE_COUNT, 1)
            self._drops.stale_samples += 1
            self._consume([item])
            return
        if len(item.sample.token_ids) > self.token_budget:
            if not self._warned_oversize:
                logger.warning(
                    "dropping a sample of %d tokens: it exceeds token_budget=%d (counted in %s); raise "
                    "`token_budget` or lower `max_completion_length`",
                    len(item.sample.token_ids), self.token_budget, M.BATCH_DROPPED_OVERSIZE_COUNT,
                )
                self._warned_oversize = True
            self.record(M.BATCH_DROPPED_OVERSIZE_COUNT, 1)
            self._drops.oversize_samples += 1
            self._consume([item])
            self._check_some_sample_fits(len(item.sample.token_ids))
            return
        self._took_any = True
        self._drops, self._last_trainable = DropTally(), time.monotonic()
        self.record(M.SAMPLE_TIME_IN_QUEUE_S, time.time() - item.queued_at)
        self.record(M.SAMPLE_FORWARDED_TOKENS_MEAN, item.sample.num_tokens)
        self.record(M.SAMPLE_FORWARDED_TOKENS_MAX, item.sample.num_tokens)
        self.record(M.SAMPLE_TRAINED_TOKENS_MEAN, item.sample.num_trained)
        self.record(M.ROLLOUT_QUEUE_SIZE, _qsize(self.channel.samples))
        self._meta[id(item.sample)] = item
        self._ready.extend(self.batcher.add(item.sample))

    def _check_some_sample_fits(self, num_tokens: int) -> None:
        """Stop a run whose first OVERSIZE_LIMIT samples were all too long for the token budget: no step
        could ever be taken, and samples arriving to be dropped would hide the wait from its notice."""
        if self._took_any:
            return
        self._oversize.append(num_tokens)
        if len(self._oversize) >= OVERSIZE_LIMIT:
            raise ValueError(
                f"the first {len(self._oversize)} samples were all longer than "
                f"token_budget={self.token_budget} tokens ({min(self._oversize)} to {max(self._oversize)}) "
                "and were dropped, so no step can be taken: raise `token_budget` to at least "
                f"{max(self._oversize)}, or lower `max_completion_length` (or the prompts' length)"
            )

    def _on_idle(self, item: RolloutIdle) -> None:
        """Close the partial micro-batch when the rollout process waits on the trainer (see the module
        docstring)."""
        if item.final:
            self._out_of_prompts = True
        elif item.blocked_at != self.channel.trainer_view():
            return  # outdated: the trainer consumed or stepped after the rollout process looked
        closed = self.batcher.flush()
        self._ready.extend(closed)
        if not closed and item.reason == IDLE_ON_POLICY:
            self._extend_on_policy_quota()

    def _extend_on_policy_quota(self) -> None:
        """max_staleness=0 and nothing left to train under this weight version: let the rollout process
        generate one more micro-batch's worth of tokens (see the module docstring)."""
        _, world = rank_and_world_size()
        with self.channel.token_allowance.get_lock():
            self.channel.token_allowance.value += on_policy_extension(self.token_budget, world)
        logger.debug("on-policy quota raised to %d tokens", self.channel.token_allowance.value)

    def _consume(self, items: list[QueuedSample]) -> None:
        """Samples leave the pipeline (trained or dropped): free their tokens and count their prompts."""
        tokens = sum(len(it.sample.token_ids) for it in items)
        with self.channel.consumed_tokens.get_lock():
            self.channel.consumed_tokens.value += tokens
        for it in items:
            self.progress.on_sample_consumed(it.position)

    def _run_finished(self) -> bool:
        """Every prompt of the run (positions below `total_positions`) has sent its marker, or the
        rollout process ran out of prompts."""
        if self._out_of_prompts:
            return True
        if self.total_positions is None:
            return False
        return self._markers_in_run >= self.total_positions - self._start_position

    def _next_micro_batch(self) -> Any | None:
        """Block until a micro-batch is closed; None when the run has nothing more to train."""
        if self._resumed_items:
            items, self._resumed_items = self._resumed_items, []
            for item in items:
                self._take(item)
            self._resumed_positions = {it.position for it in items if isinstance(it, GroupFinished)}
        waiting_since = time.monotonic()
        next_notice = waiting_since + self.notice_after_s
        # only time spent waiting counts toward the drought (not the steps trained in between)
        self._last_trainable = max(self._last_trainable, waiting_since)
        while not self._ready:
            if self._run_finished():
                self._ready.extend(self.batcher.flush())
                if not self._ready:
                    return None
                break
            t0 = time.perf_counter()
            try:
                item = self.channel.samples.get(timeout=self.poll_s)
            except queue_lib.Empty:
                item = None
            self.wait_s += time.perf_counter() - t0
            if item is None:  # (outside the except: a failure it reports does not chain the queue's Empty)
                self.check_health()
                self._check_trainable_samples()
                now = time.monotonic()
                if now >= next_notice:
                    self._notice_waiting(now - waiting_since)
                    next_notice = now + self.notice_after_s
                continue
            self._take(item)
            self._check_trainable_samples()
            # drain what is already there without waiting, so a burst fills rows in one go
            while not self._ready:
                try:
                    item = self.channel.samples.get_nowait()
                except queue_lib.Empty:
                    break
                self._take(item)
        return self._ready.pop(0)

    def pending_samples(self, wait_s: float = 10.0) -> list[QueuedSample]:
        """For a checkpoint: the untrained samples of the partly trained prompts (some of their samples
        trained, the rest still here or in the queue). The queue is read until each such prompt's marker
        came (its samples precede it), at most `wait_s`; a prompt whose marker does not come in time is
        left out, and generated again after a resume."""
        deadline = time.monotonic() + wait_s
        while self.progress.awaiting_marker and time.monotonic() < deadline:
            try:
                item = self.channel.samples.get(timeout=0.1)
            except queue_lib.Empty:
                item = None
            if item is None:
                self.check_health()
            else:
                self._take(item)
        missing = self.progress.awaiting_marker
        if missing:
            logger.warning(
                "checkpoint: the rest of the samples of prompts %s did not arrive within %.0f s; a run "
                "resumed from this checkpoint generates them again (their trained samples are then trained "
                "twice)",
                sorted(missing), wait_s,
            )
        partly = self.progress.partly_trained - missing
        return [item for item in self._meta.values() if item.position in partly]

    def _check_trainable_samples(self) -> None:
        """Raise when the rollout process dropped everything it produced for `no_sample_timeout_s` of waiting
        (it is alive: `check_health` runs first)."""
        if self.no_sample_timeout_s is None or not self._drops.any_dropped:
            return
        waited = time.monotonic() - self._last_trainable
        if waited < self.no_sample_timeout_s:
            return
        drops = self._drops
        groups = drops.unscored_groups + drops.equal_reward_groups + drops.filtered_prompts
        raise RuntimeError(
            f"no trainable sample for {waited:.0f} s (rollout_worker_timeout={self.no_sample_timeout_s:g}) "
            f"while the rollout process is alive: {groups} groups finished and were all dropped, as were "
            f"{drops.stale_samples + drops.oversize_samples} samples. By cause: "
            f"{drops.describe(max_staleness=self.max_staleness, token_budget=self.token_budget)}. Nothing "
            "could be trained, so the run stops; fix the cause above (or raise rollout_worker_timeout if "
            "samples come later)"
        )

    def _notice_waiting(self, waited_s: float) -> None:
        if self._markers_seen and self._empty_markers == self._markers_seen:
            # nothing to learn from so far: say it loudly, a run like this never takes a step
            logger.warning(
                "waited %.0fs for rollout samples: all %d prompts finished so far were dropped (equal "
                "rewards within every group, or rejected by filter_prompt), so there is nothing to train "
                "on; check that the model can do the task at all and what the reward functions return (see "
                "frac_reward_zero_std)",
                waited_s, self._markers_seen,
            )
            return
        logger.info(
            "waited %.0fs for rollout samples (%d prompts finished so far, %d of them dropped: zero "
            "reward std or filtered); if this persists, check the reward function and frac_reward_zero_std",
            waited_s, self._markers_seen, self._empty_markers,
        )

    # -- every rank -------------------------------------------------------------------------------

    def __iter__(self) -> Iterator[MicroBatchInput]:
        rank, world = rank_and_world_size()
        while not self._finished:
            payload: list[Any] = [None] * world
            if rank == 0:
                micro_batch = self._next_micro_batch()
                if micro_batch is None:
                    self._finished = True
                else:
                    payload = self._split(micro_batch, world)
            if world > 1:
                received: list[Any] = [None]
                dist.scatter_object_list(received, payload if rank == 0 else None, src=0)
                mine = received[0]
            else:
                mine = payload[0]
            if mine is None:
                self._finished = True
                return
            yield mine

    def _split(self, micro_batch: Any, world: int) -> list[MicroBatchInput]:
        rows = micro_batch.rows
        assert len(rows) == world, f"batcher made {len(rows)} rows for {world} processes"
        items_per_row = [[self._meta.pop(id(sample)) for sample in row] for row in rows]
        num_trained = sum(sum(it.sample.trained_mask) for row in items_per_row for it in row)
        stats = micro_batch.metrics()
        for row in items_per_row:
            self._consume(row)
        return [
            MicroBatchInput(
                samples=[it.sample for it in row],
                num_trained_tokens_global=int(num_trained),
                stats=stats,
                positions=[it.position for it in row],
            )
            for row in items_per_row
        ]


def _with_markers(samples: list[QueuedSample]) -> list[Any]:
    """Resumed samples, each prompt's followed by its marker (as the rollout process sends them)."""
    items: list[Any] = []
    by_position: dict[int, list[QueuedSample]] = {}
    for item in samples:
        by_position.setdefault(item.position, []).append(item)
    for position, group in sorted(by_position.items()):
        items += group
        items.append(GroupFinished(position, group[0].row_index, len(group)))
    return items


def _qsize(q: Any) -> int:
    try:
        return q.qsize()
    except NotImplementedError:  # macOS multiprocessing queues
        return -1
