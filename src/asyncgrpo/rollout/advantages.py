"""Group advantages and the zero-std group filter (pure).

A group's rewards hold one value per rollout, NaN where no reward source scored the rollout.

    A_i = (r_i - mean) / (std + 1e-8)   over the scored (non-NaN) rewards, population std
    A_i = 0                             for an unscored (NaN) rollout

A group whose scored rewards are all equal, or that has fewer than two scored rollouts, carries no
signal and is dropped after `compute_advantages` ran (`is_zero_std`); it still counts toward the epoch.
"Equal" allows float rounding (`ZERO_STD_RTOL`): rewards such as 0.1 + 0.2 and 0.3 differ only in
their last bits, and standardising that difference would turn rounding noise into advantages of +-1.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

ADVANTAGE_EPS = 1e-8
ZERO_STD_RTOL = 1e-6  # a group's std at most this times its largest |reward| (or 1) counts as zero


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
    """Whether a group carries no signal: fewer than two scored rewards, or all scored rewards equal up
    to float rounding (population std <= `ZERO_STD_RTOL` * max(1, max |reward|))."""
    r = _as_rewards(rewards)
    values = r[~np.isnan(r)]
    if values.size < 2:
        return True
    return bool(values.std() <= ZERO_STD_RTOL * max(1.0, float(np.abs(values).max())))


def scored_std(rewards: np.ndarray | Sequence[float | None]) -> float:
    """Population std of the scored (non-NaN) rewards; NaN when none is scored."""
    r = _as_rewards(rewards)
    values = r[~np.isnan(r)]
    return float(values.std()) if values.size else float("nan")


def check_advantages(advantages: np.ndarray, num_rollouts: int) -> np.ndarray:
    """`compute_advantages`' result as float64, checked: one finite value per rollout (an inf or NaN
    advantage would make the loss, and then every weight, NaN)."""
    advantages = np.asarray(advantages, dtype=np.float64)
    if advantages.shape != (num_rollouts,):
        raise ValueError(
            f"compute_advantages returned shape {advantages.shape} for a group of {num_rollouts} rollouts; "
            "return one advantage per rollout"
        )
    if not np.isfinite(advantages).all():
        raise ValueError(
            f"compute_advantages returned non-finite advantages {advantages.tolist()}; return finite values "
            "(0 for a rollout that should not be trained)"
        )
    return advantages
