"""Turn reconciliation: a rollout's sampling requests -> training sequences (pure).

Each turn of a multi-turn rollout re-renders the whole conversation with the chat template, so a
turn's prompt is not always the tokens held so far (a template may drop earlier reasoning, or
re-tokenize differently). The rule, applied turn by turn:

    held = tokens of the current sequence (context + outputs so far)
    turn.prompt_ids starts with held  -> extend: append the prompt tail as context, the outputs trained
    otherwise (a fork)                -> start a new sequence: the turn's full prompt as context, then
                                         its outputs; `drift` = len(held) - common prefix length

Invariant: every generated token whose `output_mask` is 1 is trained in exactly one sequence; a
fork costs forwarded tokens (tree packing shares the common prefix) but never training signal.
Sequences without any trained token are not returned.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from asyncgrpo.types import TrainingSequence, TurnRecord, check_turn


@dataclass(frozen=True)
class ReconciledRollout:
    """The training sequences of one rollout and how its turns were joined.

    Attributes:
        sequences: Sequences with at least one trained token, in the order they were started.
        num_transitions: Turn transitions (number of turns - 1, or 0).
        num_forks: Transitions whose prompt did not start with the held tokens.
        drift_tokens: One entry per transition: held tokens a fork re-rendered (0 for an extension).
    """

    sequences: list[TrainingSequence]
    num_transitions: int
    num_forks: int
    drift_tokens: list[int] = field(default_factory=list)


def common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    """Number of leading tokens `a` and `b` share."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class _SequenceBuilder:
    """Accumulates one sequence: tokens plus aligned per-token training fields."""

    def __init__(self) -> None:
        self.token_ids: list[int] = []
        self.trained: list[int] = []
        self.log_probs: list[float] = []
        self.top: list[dict[int, float] | None] = []
        self.candidates: list[list[int] | None] = []
        self.has_top = False
        self.has_candidates = False

    def add_context(self, ids: Sequence[int]) -> None:
        n = len(ids)
        self.token_ids.extend(ids)
        self.trained.extend([0] * n)
        self.log_probs.extend([0.0] * n)
        self.top.extend([None] * n)
        self.candidates.extend([None] * n)

    def add_outputs(self, turn: TurnRecord) -> None:
        flags = turn.trained_flags()
        if any(flags) and not self.token_ids:
            raise ValueError(
                "a turn with an empty prompt_ids has trained output tokens: the first token of a "
                "sequence has no position predicting it; send at least one prompt token (e.g. BOS)"
            )
        for i, token in enumerate(turn.output_ids):
            trained = flags[i]
            self.token_ids.append(token)
            self.trained.append(trained)
            self.log_probs.append(float(turn.output_log_probs[i]) if trained else 0.0)
            top = turn.output_sampler_logprobs[i] if trained and turn.output_sampler_logprobs else None
            cand = turn.output_sampling_mask[i] if trained and turn.output_sampling_mask else None
            self.top.append(top)
            self.candidates.append(cand)
            self.has_top |= top is not None
            self.has_candidates |= cand is not None

    def build(self) -> TrainingSequence | None:
        if not any(self.trained):
            return None
        return TrainingSequence(
            token_ids=self.token_ids,
            trained_mask=self.trained,
            sampler_logprobs=self.log_probs,
            sampler_topk=self.top if self.has_top else None,
            candidate_sets=self.candidates if self.has_candidates else None,
        )


def reconcile_turns(turns: Sequence[TurnRecord], rollout_id: str = "") -> ReconciledRollout:
    """Lay out a rollout's turns as training sequences, extending or forking at each turn.

    Args:
        turns: The rollout's sampling requests, in order.
        rollout_id: Only used to name the rollout in error messages.

    Returns:
        The sequences (each with >= 1 trained token) and the per-transition fork/drift statistics.
    """
    builders: list[_SequenceBuilder] = []
    drift: list[int] = []
    num_forks = 0
    for index, turn in enumerate(turns):
        check_turn(turn, where=f"rollout {rollout_id or '?'}, turn {index}")
        prompt = list(turn.prompt_ids)
        current = builders[-1] if builders else None
        held = current.token_ids if current is not None else None
        if held is not None and prompt[: len(held)] == held:
            current.add_context(prompt[len(held) :])
            drift.append(0)
        else:
            if held is not None:
                num_forks += 1
                drift.append(len(held) - common_prefix_length(held, prompt))
            current = _SequenceBuilder()
            current.add_context(prompt)
            builders.append(current)
        current.add_outputs(turn)
    sequences = [s for s in (b.build() for b in builders) if s is not None]
    return ReconciledRollout(
        sequences=sequences,
        num_transitions=max(len(turns) - 1, 0),
        num_forks=num_forks,
        drift_tokens=drift,
    )
