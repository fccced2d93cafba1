"""Fault 1: inf/NaN rewards never reach an advantage; a non-finite loss or gradient never reaches the
optimizer (the weights, then the server)."""

from __future__ import annotations

import asyncio
import logging

import numpy as np
import pytest
import torch

from asyncgrpo.rollout.advantages import check_advantages
from asyncgrpo.rollout.rewards import RewardFunctionError, score_group
from asyncgrpo.train.nonfinite import NonFiniteGuard, NonFiniteStepError, drop_gradients
from asyncgrpo.types import RolloutGroup


def _group(n=4, env_rewards=None, rollout_rewards=None):
    return RolloutGroup(
        prompts=[[{"role": "user", "content": "q"}]] * n,
        reward_kwargs={},
        completions=[[{"role": "assistant", "content": f"c{i}"}] for i in range(n)],
        completions_ids=[[i] for i in range(n)],
        completions_sequences=[[] for _ in range(n)],
        tool_call_counts=[0] * n,
        tool_failure_counts=[0] * n,
        model_version=0,
        group_id=0,
        row_index=0,
        env_rewards=env_rewards or [None] * n,
        rollout_rewards=rollout_rewards or [None] * n,
    )


class CounterEnv:
    pass


@pytest.mark.parametrize("value", [float("inf"), float("-inf")])
def test_an_infinite_reward_is_a_reward_error_naming_the_function_and_the_value(value):
    def clipped_reward(completions, **kwargs):
        return [1.0, value, 0.0, 0.0]

    with pytest.raises(RewardFunctionError,
                       match=rf"reward function 'clipped_reward' returned {value} for completion 1"):
        asyncio.run(score_group(_group(), [clipped_reward]))


def test_an_infinite_environment_or_rollout_reward_is_named_too():
    env = [(CounterEnv, 1.0), (CounterEnv, float("inf")), None, None]
    with pytest.raises(RewardFunctionError, match=r"CounterEnv.get_reward returned inf for completion 1"):
        asyncio.run(score_group(_group(env_rewards=env), []))
    with pytest.raises(RewardFunctionError, match=r"Rollout.reward .* returned -inf for completion 3"):
        asyncio.run(score_group(_group(rollout_rewards=[0.0, 1.0, 0.0, float("-inf")]), []))


def test_nan_rewards_still_mean_not_applicable():
    def sometimes(completions, **kwargs):
        return [1.0, float("nan"), 0.0, None]

    scores = asyncio.run(score_group(_group(), [sometimes]))
    np.testing.assert_array_equal(np.isnan(scores.totals), [False, True, False, True])


def test_non_finite_advantages_from_a_custom_compute_advantages_are_refused():
    assert check_advantages(np.array([1.0, -1.0]), 2).tolist() == [1.0, -1.0]
    with pytest.raises(ValueError, match="non-finite advantages"):
        check_advantages([0.5, float("nan")], 2)
    with pytest.raises(ValueError, match="shape"):
        check_advantages([0.5], 2)


def test_the_guard_passes_finite_steps_and_skips_non_finite_ones(caplog):
    guard = NonFiniteGuard(max_consecutive=3)
    guard.add_loss(torch.tensor(0.3))
    assert guard.step_is_finite(torch.tensor(1.5), step=1)
    with caplog.at_level(logging.WARNING, logger="asyncgrpo.train.nonfinite"):
        assert not guard.step_is_finite(torch.tensor(float("nan")), step=2)
    assert "step 2: non-finite loss or gradient" in caplog.text
    guard.add_loss(torch.tensor(float("inf")))  # an inf loss with a finite norm is skipped as well
    assert not guard.step_is_finite(torch.tensor(0.1), step=3)
    assert guard.consecutive == 2 and guard.total_skipped == 2
    assert guard.step_is_finite(0.2, step=4)  # the loss flag does not leak into the next step
    assert guard.consecutive == 0


def test_the_guard_stops_training_after_consecutive_non_finite_steps():
    guard = NonFiniteGuard(max_consecutive=3)
    assert not guard.step_is_finite(float("inf"), step=1)
    assert not guard.step_is_finite(float("nan"), step=2)
    with pytest.raises(NonFiniteStepError, match="3 optimizer steps in a row .* step 3"):
        guard.step_is_finite(float("nan"), step=3)


def test_dropped_gradients_leave_weights_and_optimizer_state_untouched():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.1)
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()  # one real step: the optimizer has state to keep
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    steps_before = [s["step"].item() for s in optimizer.state.values()]
    model(torch.randn(2, 4)).sum().backward()
    next(model.parameters()).grad[0, 0] = float("nan")
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    guard = NonFiniteGuard()
    assert not guard.step_is_finite(norm, step=2)
    drop_gradients(model)
    optimizer.step()
    for name, param in model.named_parameters():
        assert torch.equal(param, before[name]), name
    assert [s["step"].item() for s in optimizer.state.values()] == steps_before
