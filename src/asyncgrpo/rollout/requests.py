"""One sampling request of the rollout process: its settings, its seed and the rollout it belongs to.

    AsyncGRPOConfig --RequestSettings.from_config (once)--> SamplingParams of every turn
    (position, rollout index, turn) --request_seed--> a seed no other request of the run uses
    RolloutContext, set per rollout task in a context variable: what `generate_one_turn` needs to know
    about its rollout without changing the hook's signature
"""

from __future__ import annotations

import contextvars
import hashlib
import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from asyncgrpo.config import AsyncGRPOConfig
from asyncgrpo.generation.protocol import SamplingParams


def request_seed(base_seed: int, position: int, rollout_index: int, turn_index: int) -> int:
    """A per-request sampling seed in [0, 2**63): unique per (run seed, prompt position, rollout, turn).

    Data-parallel servers would otherwise decode identical text for a group (see duplicate_frac).
    """
    key = f"{base_seed}:{position}:{rollout_index}:{turn_index}".encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") >> 1


@dataclass(frozen=True)
class RequestSettings:
    """The config's sampling fields, read once. Top-K sampler log-probs (`num_sampler_logprobs`) are
    asked for only with `score_centering`; a request stops at any of the EOS ids and is capped at
    `max_completion_length` new tokens."""

    temperature: float
    top_k: int
    top_p: float
    min_p: float
    max_tokens: int
    num_logprobs: int
    repetition_penalty: float
    stop_token_ids: tuple[int, ...]
    truncated: bool  # top_k / top_p / min_p restrict the draw: candidate sets matter

    @classmethod
    def from_config(cls, config: AsyncGRPOConfig, eos_token_ids: Sequence[int]) -> RequestSettings:
        return cls(
            temperature=float(config.temperature),
            top_k=config.top_k,
            top_p=float(config.top_p),
            min_p=float(config.min_p or 0.0),  # None disables it, as 0 does
            max_tokens=config.max_completion_length,
            num_logprobs=config.num_sampler_logprobs if config.score_centering else 0,
            repetition_penalty=float(config.repetition_penalty),
            stop_token_ids=tuple(int(t) for t in eos_token_ids),
            truncated=config.sampling_is_truncated,
        )

    def describe_truncation(self) -> str:
        return f"top_k={self.top_k} / top_p={self.top_p} / min_p={self.min_p}"

    def params(self, *, seed: int, return_sampling_mask: bool) -> SamplingParams:
        return SamplingParams(
            temperature=self.temperature,
            top_k=self.top_k,
            top_p=self.top_p,
            min_p=self.min_p,
            max_tokens=self.max_tokens,
            seed=seed,
            logprobs=self.num_logprobs,
            repetition_penalty=self.repetition_penalty,
            stop_token_ids=self.stop_token_ids,
            return_sampling_mask=return_sampling_mask,
        )


@dataclass
class RolloutContext:
    """Per-rollout state that `generate_one_turn` reads without changing the hook's signature."""

    position: int
    rollout_index: int
    model_version: int
    num_turns: int = 0
    row: dict | None = None  # the prompt's dataset row (a harness gets it)
    server: int = 0  # its group's server (an index into vllm_server_base_url): every turn goes there


CURRENT_ROLLOUT: contextvars.ContextVar[RolloutContext | None] = contextvars.ContextVar(
    "asyncgrpo_current_rollout", default=None
)


class RequestSeeds:
    """The seed of the next request: from the current rollout's (position, index, turn), or, for a
    request made outside a rollout (a custom hook), from a counter, so that no seed repeats."""

    def __init__(self, base_seed: int) -> None:
        self.base_seed = base_seed
        self._outside = itertools.count(1)

    def next(self) -> int:
        context = CURRENT_ROLLOUT.get()
        if context is None:
            return request_seed(self.base_seed, -1, next(self._outside), 0)
        seed = request_seed(self.base_seed, context.position, context.rollout_index, context.num_turns)
        context.num_turns += 1
        return seed
