"""Admission: when the rollout process may start a group, and which samples the trainer still trains.

One home for the token-allowance / staleness protocol, imported by both processes. Pure: no clock,
no I/O, no asyncio; the rollout loop and the trainer call these and publish the results through
`asyncgrpo.rollout.channel`.

    trainer (rank 0)                                    rollout process (`Admission`)
    ----------------                                    -----------------------------
    before the first step: initial_allowance(...)  -->  blocker(...): may a group start now?
    after each optimizer step: allowance_after_step -->   1. concurrency: in-flight rollouts vs the KV cap
    on-policy, nothing left: += on_policy_extension -->   2. staleness: queued + in-flight tokens vs allowance
    taking a sample: is_stale(...) -> drop                3. max_staleness=0: one step's worth per version

The allowance is in tokens: `max(max_staleness, 1)` optimizer steps' worth of what the trainer
consumed in its last step, every process's rows included (before the first step: every row full).
Until the first group finishes, the size of a group is unknown: one group at a time. With nothing
held and nothing in flight one group may always start, so a group larger than the allowance cannot
deadlock. With `max_staleness=0`, one step's worth of tokens is started per weight version; a group
that yields no sample (dropped for zero reward std) gives its share back, so a version whose groups
are all dropped does not wait for a sync that never comes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from asyncgrpo.rollout.channel import IDLE_ON_POLICY, IDLE_STALENESS, TrainerView

BLOCKED_CONCURRENCY = "concurrency"  # the KV cap or max_concurrent_rollouts: a rollout ending frees a slot
BLOCKED_FIRST_GROUP = "first group"  # the first group is still generating: its size is the estimate

TOKEN_ESTIMATE_DECAY = 0.8  # weight of the old tokens-per-rollout estimate (completions grow or shrink)


# -- the trainer's side ------------------------------------------------------------------------------


def initial_allowance(
    *, num_processes: int, token_budget: int, gradient_accumulation_steps: int, max_staleness: int
) -> int:
    """The allowance before the first step: `max(max_staleness, 1)` steps of full rows, every process's."""
    return max(max_staleness, 1) * num_processes * token_budget * gradient_accumulation_steps


def allowance_after_step(consumed_tokens: int, max_staleness: int) -> int:
    """The allowance after an optimizer step that consumed `consumed_tokens` (all processes' rows)."""
    return max(max_staleness, 1) * max(consumed_tokens, 1)


def on_policy_extension(token_budget: int, num_processes: int) -> int:
    """What the trainer adds to the allowance when, with `max_staleness=0`, it runs out of samples
    before the weight version changes: one micro-batch (a row per process)."""
    return token_budget * num_processes


def staleness(model_version: int, current_version: int) -> int:
    """Weight updates between the policy that generated a sample and the one training it: the difference
    of two `WeightVersion`s (a sample carries its version as a plain int)."""
    return current_version - model_version


def is_stale(model_version: int, current_version: int, max_staleness: int) -> bool:
    """Whether a sample generated at `model_version` is too old to train at `current_version`
    (a sample exactly `max_staleness` versions behind is still trained)."""
    return staleness(model_version, current_version) > max_staleness


# -- the rollout process's side ----------------------------------------------------------------------


def oldest_fresh_version(current_version: int, max_staleness: int) -> int:
    """The oldest model version whose samples are still trained at `current_version`: a rollout started
    under an older one is dropped whatever it generates next (so any newer policy may serve it)."""
    return current_version - max_staleness


def may_start_group(*, held_tokens: int, allowance: int, groups_finished: int, groups_in_flight: int) -> bool:
    """Whether the staleness limit lets another group start (see the module docstring).

    Args:
        held_tokens: Tokens queued for the trainer plus the estimate for groups in flight.
        allowance: The trainer's current token allowance.
        groups_finished: Groups generated since the rollout process started.
        groups_in_flight: Groups started and still generating.
    """
    if groups_finished == 0:
        return groups_in_flight == 0
    if held_tokens <= 0 and groups_in_flight == 0:
        return True
    return held_tokens < allowance


@dataclass(frozen=True)
class Started:
    """What a group counted toward its weight version's on-policy worth when it was dispatched."""

    policy_version: int | None
    tokens: float


class Admission:
    """The rollout process's admission counters and the rule over them (one instance per loop).

    Call, in order of a group's life: `on_group_started` (dispatch), `on_rollout_finished` (each
    rollout, failed ones included), `on_group_generated` (all rollouts back, tokens known),
    `on_samples_queued` (each sample put for the trainer), `on_group_scored` (before its
    `GroupFinished` is put) and `on_group_closed` (it left the score queue). `blocker` says what keeps
    the next group from starting.
    """

    def __init__(self, max_staleness: int) -> None:
        self.max_staleness = max_staleness
        self.in_flight = 0  # rollouts started and not finished
        self.groups_generating = 0  # groups started whose rollouts are not all back
        self.groups_generated = 0  # groups whose rollouts all came back
        self.groups_open = 0  # groups dispatched whose GroupFinished is not queued yet
        self.pending_tokens = 0  # tokens of generated groups not yet queued (or dropped)
        self.produced_tokens = 0  # tokens of every sample queued for the trainer
        self.tokens_per_rollout: float | None = None  # running estimate, known once a group finished
        self.policy_version: int | None = None  # max_staleness=0: the version the counter below is for
        self.tokens_started_at_version = 0.0

    def held_tokens(self, view: TrainerView) -> float:
        """Tokens queued for the trainer, generated and being scored, and estimated for rollouts in flight."""
        queued = self.produced_tokens - view.consumed_tokens
        return max(queued, 0) + self.pending_tokens + self.in_flight * (self.tokens_per_rollout or 0.0)

    def blocker(self, num_rollouts: int, view: TrainerView, cap: int) -> str | None:
        """What keeps a group of `num_rollouts` from starting now (None: it may start), given the trainer's
        values `view` and the concurrency `cap`. With no group open only IDLE_STALENESS or IDLE_ON_POLICY
        can block (only the trainer can unblock them)."""
        if self.in_flight > 0 and self.in_flight + num_rollouts > cap:
            return BLOCKED_CONCURRENCY
        if not may_start_group(
            held_tokens=math.ceil(self.held_tokens(view)),
            allowance=view.token_allowance,
            groups_finished=self.groups_generated,
            groups_in_flight=self.groups_generating,
        ):
            return IDLE_STALENESS if self.groups_generated else BLOCKED_FIRST_GROUP
        if self.max_staleness == 0 and self._on_policy_step_full(view):
            return IDLE_ON_POLICY
        return None

    def _on_policy_step_full(self, view: TrainerView) -> bool:
        """With max_staleness=0, one step's worth of tokens is started per weight version; the next groups
        wait for the trainer's sync instead of producing samples that would be dropped stale."""
        if view.model_version != self.policy_version:
            self.policy_version, self.tokens_started_at_version = view.model_version, 0.0
        return self.groups_generated > 0 and self.tokens_started_at_version >= view.token_allowance

    def on_group_started(self, num_rollouts: int) -> Started:
        started = Started(self.policy_version, num_rollouts * (self.tokens_per_rollout or 0.0))
        self.tokens_started_at_version += started.tokens
        self.in_flight += num_rollouts
        self.groups_generating += 1
        self.groups_open += 1
        return started

    def on_rollout_finished(self) -> None:
        self.in_flight -= 1

    def on_generation_ended(self) -> None:
        """The group's rollouts are all back (or it failed): it no longer generates."""
        self.groups_generating -= 1

    def on_group_generated(self, num_tokens: int, num_rollouts: int) -> None:
        """The group's `num_rollouts` rollouts came back with `num_tokens` tokens; it goes to scoring."""
        self.groups_generated += 1
        self.pending_tokens += num_tokens
        per_rollout = num_tokens / num_rollouts
        if self.tokens_per_rollout is None:
            self.tokens_per_rollout = float(per_rollout)
        else:
            self.tokens_per_rollout = TOKEN_ESTIMATE_DECAY * self.tokens_per_rollout + (
                1 - TOKEN_ESTIMATE_DECAY
            ) * float(per_rollout)

    def on_samples_queued(self, num_tokens: int) -> None:
        self.produced_tokens += num_tokens

    def on_group_scored(self, started: Started, num_samples: int) -> None:
        """A group that gives the trainer nothing is not part of its version's on-policy worth: without
        this, a version whose groups are all dropped would wait for a sync that never comes."""
        if num_samples == 0 and started.policy_version == self.policy_version:
            self.tokens_started_at_version = max(self.tokens_started_at_version - started.tokens, 0.0)

    def on_group_left_scoring(self, num_tokens: int) -> None:
        """The group's tokens are queued (counted in `produced_tokens`) or dropped."""
        self.pending_tokens -= num_tokens

    def on_group_closed(self) -> None:
        """Its `GroupFinished` is queued: the trainer hears of everything this group produced."""
        self.groups_open -= 1
