"""What crosses the process boundary between the trainer (rank 0) and the rollout process.

    trainer (rank 0)                                   rollout process
    ----------------                                   ---------------
    model_version  (Value, int)   -- written by ---->  read when a group starts (stamps samples); a
                                                       `WeightVersion`'s value, published after its push
    token_allowance (Value, int)  -- written by ---->  read before starting a group (staleness limit)
    consumed_tokens (Value, int)  -- written by ---->  queued tokens = produced - consumed
    stop_event                    -- set by -------->  loops wind down, close() hooks run
    heartbeat (Value, float)      <---- written by --  every second, wall clock (time.time())
    failed_event + errors (Queue) <---- written by --  a worker exception: type, message, traceback
    metrics (Queue)               <---- written by --  (name, value) records, see asyncgrpo.metrics
    samples (Queue)               <---- written by --  QueuedSample, GroupFinished and RolloutIdle items

Everything here is created by the trainer with a spawn context and handed to the child; values are
plain multiprocessing primitives so no manager process is needed. The three values the trainer writes
that decide whether the rollout process may start a group (model version, token allowance, consumed
tokens) are read together as a `TrainerView`.
"""

from __future__ import annotations

import multiprocessing as mp
import multiprocessing.queues
import multiprocessing.sharedctypes
import multiprocessing.synchronize
from dataclasses import dataclass, field

from asyncgrpo.types import Sample, WeightVersion

ROLLOUT_PROCESS_NAME = "asyncgrpo-rollout"  # multiprocessing name of the spawned rollout process


@dataclass(frozen=True)
class QueuedSample:
    """One training sample and where it came from.

    `sample` holds the token ids, trained mask, sampler log-probs, advantage, group id and model
    version. `position` is the prompt's index in the rollout
    process's prompt stream (epoch * len(dataset) + index within the epoch's order); the trainer uses
    it to count epochs and the resume position.
    """

    sample: Sample
    position: int
    row_index: int
    queued_at: float  # time.time() when queued (sample/time_in_queue_s)


@dataclass(frozen=True)
class GroupFinished:
    """Sent once per prompt after its samples (if any) were queued.

    `num_samples` samples of this prompt are in the queue ahead of this marker (0 when the group was
    dropped for zero reward std or the prompt was rejected by `filter_prompt`): the prompt counts as
    trained once the trainer has consumed that many samples of it.
    """

    position: int
    row_index: int
    num_samples: int
    # the group's metric records (rewards, frac_reward_zero_std, ...): they travel with the marker, so
    # the trainer logs them in order with the group's samples, not whenever the metrics queue delivers
    records: tuple = ()


@dataclass(frozen=True)
class TrainerView:
    """The trainer's published values that decide whether the rollout process may start a group.

    Only the trainer (rank 0) writes them. The version and the consumed tokens only grow, and the
    allowance changes at an optimizer step, after micro-batches were consumed, or when the trainer
    runs out of samples under `max_staleness=0` (it raises it): two equal views mean the trainer did
    nothing in between that could let a group start.
    """

    model_version: WeightVersion
    token_allowance: int
    consumed_tokens: int


IDLE_STALENESS = "staleness"  # queued + in-flight tokens reached the token allowance
IDLE_ON_POLICY = "on-policy"  # max_staleness=0: this version's step is generated, the next waits for the sync
IDLE_OUT_OF_PROMPTS = "out of prompts"  # every prompt of the run was dispatched and finished


@dataclass(frozen=True)
class RolloutIdle:
    """The rollout process has nothing more coming until the trainer acts (or ever, when out of prompts).

    Sent on `samples` when no group is in flight or being scored and the next one cannot start, so
    every sample produced so far is ahead of it in the queue. `reason` is one of `IDLE_STALENESS`,
    `IDLE_ON_POLICY`, `IDLE_OUT_OF_PROMPTS`. `blocked_at` is the `TrainerView` the rollout process
    was blocked against (None when out of prompts): if the trainer's current view still equals it, no
    group can have started since and the trainer closes its partial micro-batch at once; otherwise
    the item is outdated, and the rollout process sends a new one if it is still blocked after seeing
    the new values.
    """

    reason: str
    blocked_at: TrainerView | None

    @property
    def final(self) -> bool:
        """Nothing more will ever come: the rollout process ran out of prompts."""
        return self.blocked_at is None


SampleQueueItem = QueuedSample | GroupFinished | RolloutIdle  # what travels on RolloutChannel.samples


@dataclass(frozen=True)
class WorkerError:
    """An exception raised in the rollout process, with its formatted traceback."""

    type_name: str
    message: str
    traceback: str


@dataclass
class RolloutChannel:
    """The shared primitives of one trainer <-> rollout-process pair (see the module docstring)."""

    samples: mp.queues.Queue  # of SampleQueueItem
    metrics: mp.queues.Queue  # of asyncgrpo.metrics.MetricRecord
    errors: mp.queues.Queue  # of WorkerError
    model_version: mp.sharedctypes.Synchronized  # int, a WeightVersion's value
    token_allowance: mp.sharedctypes.Synchronized  # int
    consumed_tokens: mp.sharedctypes.Synchronized  # int
    heartbeat: mp.sharedctypes.Synchronized  # float, time.time()
    stop_event: mp.synchronize.Event
    failed_event: mp.synchronize.Event
    extra: dict[str, mp.queues.Queue] = field(default_factory=dict)  # "completions": log_completions entries

    def trainer_view(self) -> TrainerView:
        return TrainerView(
            model_version=WeightVersion(self.model_version.value),
            token_allowance=int(self.token_allowance.value),
            consumed_tokens=int(self.consumed_tokens.value),
        )

    def close(self) -> None:
        """Release the queues without waiting for unread items: a process that put items nobody
        will read (the trainer after a stop, an in-process loop) must still be able to exit."""
        for q in (self.samples, self.metrics, self.errors, *self.extra.values()):
            if hasattr(q, "cancel_join_thread"):
                q.cancel_join_thread()
                q.close()

    @classmethod
    def from_primitives(
        cls,
        *,
        rollout_buffer: mp.queues.Queue | None,
        model_version_value: mp.sharedctypes.Synchronized | None,
        token_allowance: mp.sharedctypes.Synchronized | None,
        heartbeat_value: mp.sharedctypes.Synchronized | None,
        failed_event: mp.synchronize.Event | None,
        exception_info_queue: mp.queues.Queue | None,
        metrics_queue: mp.queues.Queue | None,
    ) -> RolloutChannel:
        """A channel over the reference's primitives, named as its `AsyncRolloutLoop.__init__` names them.
        The two it does not pass are made here: the stop event (set it to stop the loop) and the consumed
        tokens (0 until someone writes it, so `token_allowance` then bounds every token produced)."""
        given = {
            "rollout_buffer": rollout_buffer, "model_version_value": model_version_value,
            "token_allowance": token_allowance, "heartbeat_value": heartbeat_value,
            "failed_event": failed_event,
            "exception_info_queue": exception_info_queue, "metrics_queue": metrics_queue,
        }
        missing = [name for name, value in given.items() if value is None]
        if missing:
            raise TypeError(
                f"AsyncRolloutLoop needs the shared primitives {', '.join(missing)} (as in the reference), "
                "or "
                "one `channel=RolloutChannel.create(...)` that holds them all"
            )
        return cls(
            samples=rollout_buffer,
            metrics=metrics_queue,
            errors=exception_info_queue,
            model_version=model_version_value,
            token_allowance=token_allowance,
            consumed_tokens=mp.Value("q", 0),
            heartbeat=heartbeat_value,
            stop_event=mp.Event(),
            failed_event=failed_event,
        )

    def reference_primitives(self) -> dict[str, object]:
        """The primitives under the reference's argument names (the inverse of `from_primitives`)."""
        return {
            "rollout_buffer": self.samples, "model_version_value": self.model_version,
            "token_allowance": self.token_allowance, "heartbeat_value": self.heartbeat,
            "failed_event": self.failed_event, "exception_info_queue": self.errors,
            "metrics_queue": self.metrics,
        }

    @classmethod
    def create(
        cls,
        ctx: mp.context.BaseContext,
        *,
        initial_allowance: int,
        model_version: int = 0,
        completions: bool = False,
    ) -> RolloutChannel:
        """The primitives of one pair; `completions` adds the `log_completions` queue
        (`extra["completions"]`)."""
        samples, metrics, errors = ctx.Queue(), ctx.Queue(), ctx.Queue()
        # The creating process (the trainer) only reads; an in-process writer (tests, a loop run in
        # a thread) must not block its exit on items nobody reads. Spawned children reset this flag.
        for q in (samples, metrics, errors):
            q.cancel_join_thread()
        return cls(
            samples=samples,
            metrics=metrics,
            errors=errors,
            model_version=ctx.Value("q", int(model_version)),
            token_allowance=ctx.Value("q", int(initial_allowance)),
            consumed_tokens=ctx.Value("q", 0),
            heartbeat=ctx.Value("d", 0.0),
            stop_event=ctx.Event(),
            failed_event=ctx.Event(),
            extra={"completions": ctx.Queue()} if completions else {},
        )
