import math
import statistics

import numpy as np
import pytest

from asyncgrpo.rollout.advantages import compute_advantages, is_zero_std, scored_std


def reference_advantages(rewards):
    """Plain-Python GRPO standardisation: NaN/None rollouts excluded and given 0."""
    scored = [r for r in rewards if r is not None and not math.isnan(r)]
    if not scored:
        return [0.0] * len(rewards)
    mean, std = statistics.fmean(scored), statistics.pstdev(scored)
    return [0.0 if r is None or math.isnan(r) else (r - mean) / (std + 1e-8) for r in rewards]


@pytest.mark.parametrize(
    "rewards",
    [
        [1.0, 0.0, 0.0, 1.0],
        [0.3, -2.0, 5.5, 1.25, 0.0, 0.0, 7.0, 1.0],
        [1.0, float("nan"), 0.0, float("nan")],
        [2.0, None, 4.0],
        [3.0, 3.0, 3.0],
        [float("nan"), float("nan")],
    ],
)
def test_matches_plain_reference(rewards):
    np.testing.assert_allclose(compute_advantages(rewards),
                               reference_advantages(rewards), rtol=1e-12, atol=1e-12)


def test_random_groups_match_reference_and_are_centred():
    rng = np.random.default_rng(0)
    for _ in range(50):
        rewards = rng.normal(size=rng.integers(2, 17))
        rewards[rng.random(rewards.size) < 0.2] = np.nan
        advantages = compute_advantages(rewards)
        np.testing.assert_allclose(advantages, reference_advantages(list(rewards)), rtol=1e-10, atol=1e-12)
        assert abs(advantages.sum()) < 1e-9
        assert np.all(advantages[np.isnan(rewards)] == 0.0)


def test_input_is_not_modified_and_output_is_float64():
    rewards = np.array([1.0, np.nan, 0.0], dtype=np.float32)
    out = compute_advantages(rewards)
    assert out.dtype == np.float64
    assert np.isnan(rewards[1])


@pytest.mark.parametrize(
    ("rewards", "expected"),
    [
        ([1.0, 1.0, 1.0], True),
        ([0.0, 0.0], True),
        ([1.0, float("nan"), float("nan")], True),
        ([float("nan")] * 4, True),
        ([None, 2.0], True),
        ([1.0, float("nan"), 0.0], False),
        ([0.5, 0.5, 0.25], False),
        # equal up to float rounding: no signal, only rounding noise blown up to +-1 advantages
        ([0.1 + 0.2, 0.3, 0.3], True),
        ([1e6 + 1e-7, 1e6, 1e6], True),
        ([1.0, 1.0 + 1e-3], False),
        ([1e-4, 0.0, 0.0], False),
    ],
)
def test_zero_std_filter(rewards, expected):
    assert is_zero_std(rewards) is expected


def test_scored_statistics_ignore_nan():
    assert scored_std([1.0, float("nan"), 3.0]) == 1.0
    assert math.isnan(scored_std([None, None])) and math.isnan(scored_std([]))
