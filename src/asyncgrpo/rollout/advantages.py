"""Group advantages and the zero-std group filter (pure).

A group's rewards hold one value per rollout, NaN where no reward source scored the rollout.

    A_i = (r_i - mean) / (std + 1e-8)   over the scored (non-NaN) rewards, population std
    A_i = 0                             for an unscored (NaN) rollout

A group whose scored rewards are all equal, or that has fewer than two scored rollouts, carries no
signal and is dropped after `compute_advantages` ran (`is_zero_std`); it still counts toward the epoch.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

ADVANTAGE_EPS = 1e-8


def _as_rewards(rewards: np.ndarray | Sequence[float | None]) -> np.ndarray:
    """float64 copy of `rewards` with None turned into NaN."""
    if isinstance(rewards, np.ndarray):
        return rewards.astype(np.float64, copy=True)
    return np.array([np.nan if r is None else r for r in rewards], dtype=np.float64)


def compute_advantages(rewards: np.ndarray | Sequence[float | None]) -> np.ndarray:
    """Standardise rewards within a group.

    Args:
        rewards: Shape (num_rollouts,); NaN (or None) marks an unscored rollout.

    Returns:
        float64 array of shape (num_rollouts,): (r - mean) / (std + 1e-8) over the scored rewards
        (population std), 0 for unscored rollouts; all zeros when nothing was scored.
    """
    r = _as_rewards(rewards)
    advantages = np.zeros_like(r)
    scored = ~np.isnan(r)
    if scored.any():
        values = r[scored]
        advantages[scored] = (values - values.mean()) / (values.std() + ADVANTAGE_EPS)
    return advantages


def is_zero_std(rewards: np.ndarray | Sequence[float | None]) -> bool:
    """Whether a group carries no signal: fewer than two scored rewards, or all scored rewards equal."""
    r = _as_rewards(rewards)
    values = r[~np.isnan(r)]
    return values.size < 2 or bool(np.all(values == values[0]))


def scored_std(rewards: np.ndarray | Sequence[float | None]) -> float:
    """Population std of the scored (non-NaN) rewards; NaN when none is scored."""
    r = _as_rewards(rewards)
    values = r[~np.isnan(r)]
    return float(values.std()) if values.size else float("nan")


def scored_mean(rewards: np.ndarray | Sequence[float | None]) -> float:
    """Mean of the scored (non-NaN) rewards; NaN when none is scored."""
    r = _as_rewards(rewards)
    values = r[~np.isnan(r)]
    return float(values.mean()) if values.size else float("nan")
