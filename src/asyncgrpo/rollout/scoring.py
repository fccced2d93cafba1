"""The scoring stage of the rollout process: rewards -> advantages -> zero-std drop -> samples on the queue.

    group tasks --put--> score queue (bounded) --> Scorer.run: one group at a time, each bounded by
                                                   rollout_worker_timeout
    RolloutGroup --rewards.score_group--> totals per rollout (+ per reward source)
                 --compute_advantages---> one advantage per rollout (the loop's hook)
                 --is_zero_std----------> dropped: no sample, the rewards still logged
                 --group_samples--------> one Sample per training sequence, carrying its rollout's advantage
                 --> channel.samples: its QueuedSamples, then its GroupFinished

`score_group` and the record builders are pure (but for the reward functions they call); `Scorer` is
the asyncio task that drives them and tells the admission state what left.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from asyncgrpo import metrics as M
from asyncgrpo.rollout import advantages as adv
from asyncgrpo.rollout import rewards
from asyncgrpo.rollout.admission import Admission, Started
from asyncgrpo.rollout.channel import GroupFinished, QueuedSample, RolloutChannel
from asyncgrpo.rollout.dropped_groups import DroppedGroupsWatch
from asyncgrpo.types import Rollout, RolloutGroup, Sample

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ScoredGroup:
    """What scoring made of a group: its advantages, whether it is dropped, its samples and metrics."""

    advantages: np.ndarray
    dropped: bool
    samples: list[Sample]
    records: list[M.MetricRecord]


@dataclass
class PendingGroup:
    """A generated group waiting in the score queue."""

    group: RolloutGroup
    rollouts: list[Rollout]
    position: int
    num_tokens: int
    started: Started


class Scorer:
    """Takes generated groups off the score queue, scores them and queues their samples for the trainer.

    Args:
        channel: Where samples, markers, metrics and completions go.
        admission: Told when a group's samples are queued and when it leaves scoring.
        reward_funcs, reward_names: The reward functions and their metric names.
        compute_advantages: The loop's hook.
        timeout_s: `rollout_worker_timeout`, the limit on scoring one group.
        log_completions: Send each group's first rollout to the trainer's completions table.
        on_progress: Called when a group leaves scoring (the dispatcher wakes).
        maxsize: Score queue size; group tasks wait when it is full (`rollout/score_block_s`).
    """

    def __init__(
        self,
        *,
        channel: RolloutChannel,
        admission: Admission,
        reward_funcs: Sequence[Callable],
        reward_names: Sequence[str],
        compute_advantages: Callable[[RolloutGroup], np.ndarray],
        timeout_s: float,
        log_completions: bool,
        on_progress: Callable[[], None],
        maxsize: int,
    ) -> None:
        self.channel = channel
        self.admission = admission
        self.reward_funcs = list(reward_funcs)
        self.reward_names = list(reward_names)
        self.compute_advantages = compute_advantages
        self.timeout_s = timeout_s
        self.log_completions = log_completions
        self.on_progress = on_progress
        self.queue: asyncio.Queue[PendingGroup] = asyncio.Queue(maxsize=maxsize)
        self._dropped_watch = DroppedGroupsWatch()

    async def put(self, pending: PendingGroup) -> None:
        start = time.perf_counter()
        pending.group.queued_at = time.monotonic()
        await self.queue.put(pending)
        self._record(M.ROLLOUT_SCORE_BLOCK_S, time.perf_counter() - start)
        self._record(M.ROLLOUT_SCORE_QUEUE_SIZE, self.queue.qsize())

    async def run(self) -> None:
        while True:
            try:
                pending = await asyncio.wait_for(self.queue.get(), timeout=1.0)
            except asyncio.TimeoutError:
                continue
            self._record(M.ROLLOUT_SCORE_WAIT_S, time.monotonic() - pending.group.queued_at)
            start = time.perf_counter()
            try:
                await asyncio.wait_for(self._score(pending), timeout=self.timeout_s)
            except asyncio.TimeoutError:
                raise TimeoutError(
                    f"scoring group {pending.group.group_id} (position {pending.position}) took more than "
                    f"rollout_worker_timeout={self.timeout_s:g} s: a reward function or an environment's "
                    "get_reward is stuck; fix it or raise rollout_worker_timeout"
                ) from None
            finally:
                self.admission.on_group_left_scoring(pending.num_tokens)
            self.admission.on_group_closed()
            self.on_progress()
            self._record(M.ROLLOUT_SCORE_S, time.perf_counter() - start)

    async def _score(self, pending: PendingGroup) -> None:
        group = pending.group
        scored = await score_group(
            group,
            [r.rollout_id for r in pending.rollouts],
            reward_funcs=self.reward_funcs,
            reward_names=self.reward_names,
            compute_advantages=self.compute_advantages,
        )
        warning = self._dropped_watch.observe(group.rewards, kept=not scored.dropped)
        if warning is not None:
            logger.warning(warning)
        for sample in scored.samples:
            self.admission.on_samples_queued(sample.num_tokens)
            self.channel.samples.put(QueuedSample(sample, pending.position, group.row_index, time.time()))
        self.admission.on_group_scored(pending.started, len(scored.samples))
        self.channel.samples.put(
            GroupFinished(pending.position, group.row_index, len(scored.samples), tuple(scored.records))
        )
        if self.log_completions:
            self._log_completion(pending, scored.advantages)

    def _log_completion(self, pending: PendingGroup, advantages: np.ndarray) -> None:
        """The group's first rollout, to `channel.extra["completions"]` if the trainer made that queue,
        else to this process's log."""
        group = pending.group
        entry = completion_entry(group, pending.position, advantages)
        completions_queue = self.channel.extra.get("completions")
        if completions_queue is not None:
            completions_queue.put(entry)
        else:
            text = " | ".join(str(m.get("content", "")) for m in group.completions[0])
            logger.info("group %d (position %d), reward %.3f: %s", group.group_id, pending.position,
                        entry["reward"], text)

    def _record(self, name: str, value: float) -> None:
        self.channel.metrics.put(M.metric(name, value))


async def score_group(
    group: RolloutGroup,
    rollout_ids: Sequence[str],
    *,
    reward_funcs: Sequence[Callable],
    reward_names: Sequence[str],
    compute_advantages: Callable[[RolloutGroup], np.ndarray],
) -> ScoredGroup:
    """Score `group` (sets `group.rewards`), compute its advantages and, unless every reward is equal,
    its training samples."""
    scores = await rewards.score_group(group, reward_funcs, reward_names)
    group.rewards = np.asarray(scores.totals, dtype=np.float64)
    advantages = adv.check_advantages(compute_advantages(group), len(group))
    dropped = adv.is_zero_std(group.rewards)
    samples_per_rollout = [len(s) for s in group.completions_sequences]
    records = reward_records(group.rewards, scores.per_source, samples_per_rollout, dropped=dropped)
    samples = [] if dropped else group_samples(group, rollout_ids, advantages)
    return ScoredGroup(advantages, dropped, samples, records)


def reward_records(
    rewards: np.ndarray,
    per_source: Mapping[str, np.ndarray],
    samples_per_rollout: Sequence[int],
    *,
    dropped: bool,
) -> list[M.MetricRecord]:
    """Reward metrics of one scored group (NaN = unscored rollout).

    `reward` covers every scored rollout; `reward_kept` / `reward_dropped` split it by the group's
    fate; `frac_reward_zero_std` is one 0/1 item per group. For a kept group, `reward_group_std` and
    `rewards/{source}/group_std` are weighted by the group's trained samples and
    `rewards/{source}/mean` by each rollout's samples ("over trained samples"); a source that scored no
    rollout of the group (None: not applicable, e.g. another environment's task) records neither.
    """
    scored = rewards[~np.isnan(rewards)]
    records = [M.metric(M.FRAC_REWARD_ZERO_STD, float(dropped))]
    split = M.REWARD_DROPPED if dropped else M.REWARD_KEPT
    for value in scored:
        records += [M.metric(M.REWARD, value), M.metric(split, value)]
    if dropped:
        return records
    num_samples = sum(samples_per_rollout)
    records.append(M.metric(M.REWARD_GROUP_STD, adv.scored_std(rewards), weight=num_samples))
    for name, values in per_source.items():
        for value, count in zip(values, samples_per_rollout, strict=True):
            if count and not math.isnan(value):
                records.append(M.metric(M.reward_mean(name), value, weight=count))
        if not np.isnan(values).all():  # a source that applies to none of the group's rollouts has no std
            records.append(M.metric(M.reward_group_std(name), adv.scored_std(values), weight=num_samples))
    return records


def group_samples(group: RolloutGroup, rollout_ids: Sequence[str], advantages: np.ndarray) -> list[Sample]:
    """The training samples of a kept group: every sequence of rollout i carries advantage i."""
    samples = []
    for rollout_id, sequences, advantage in zip(rollout_ids, group.completions_sequences, advantages,
                                                strict=True):
        for seq in sequences:
            samples.append(
                Sample(
                    token_ids=seq.token_ids,
                    trained_mask=seq.trained_mask,
                    sampler_logprobs=seq.sampler_logprobs,
                    advantage=float(advantage),
                    group_id=group.group_id,
                    sampler_topk=seq.sampler_topk,
                    candidate_sets=seq.candidate_sets,
                    model_version=group.model_version,
                    rollout_id=rollout_id,
                )
            )
    return samples


def completion_entry(group: RolloutGroup, position: int, advantages: np.ndarray) -> dict[str, Any]:
    """`log_completions`: the group's first rollout, as the trainer's completions table shows it."""
    return {
        "position": position,
        "group_id": group.group_id,
        "model_version": group.model_version,
        "prompt": group.prompts[0],
        "completion": group.completions[0],
        "reward": float(group.rewards[0]),
        "advantage": float(advantages[0]),
    }
