"""The trainer refuses, at construction, a run with no reward source: no reward function and an
environment whose class has no get_reward."""

import functools

import pytest
from datasets import Dataset

from asyncgrpo import AsyncGRPOConfig, AsyncGRPOTrainer

pytestmark = pytest.mark.engine  # each trainer loads the tiny model in this process

MODEL = "asyncgrpo/tiny-chat"


class ScorelessEnv:
    def reset(self, **kwargs):
        return None

    def step(self, x: int) -> int:
        """Add one.

        Args:
            x: a number
        """
        return x + 1


class ScoredEnv(ScorelessEnv):
    def get_reward(self) -> float:
        return 1.0


def make_scoreless_env(**kwargs):
    return ScorelessEnv()


def prompts():
    return Dataset.from_dict({"prompt": [[{"role": "user", "content": "hi"}]] * 2})


def config(tmp_path):
    return AsyncGRPOConfig(output_dir=str(tmp_path), use_cpu=True, num_generations=2, max_steps=1)


@pytest.mark.parametrize(
    "factory",
    [ScorelessEnv, make_scoreless_env, functools.partial(ScorelessEnv), {"a": ScoredEnv, "b": ScorelessEnv}],
    ids=["class", "function", "partial", "dict-with-one-scoreless"],
)
def test_an_environment_without_get_reward_and_no_reward_funcs_is_refused(tmp_path, factory):
    with pytest.raises(ValueError) as info:
        AsyncGRPOTrainer(MODEL, args=config(tmp_path), train_dataset=prompts(), environment_factory=factory)
    message = str(info.value)
    assert "ScorelessEnv" in message and "get_reward" in message and "reward_funcs" in message


def test_an_environment_with_get_reward_is_a_reward_source(tmp_path):
    AsyncGRPOTrainer(MODEL, args=config(tmp_path), train_dataset=prompts(), environment_factory=ScoredEnv)


def test_reward_funcs_make_a_scoreless_environment_fine(tmp_path):
    def reward(completions, **kwargs):
        return [0.0] * len(completions)

    AsyncGRPOTrainer(
        MODEL, reward_funcs=reward, args=config(tmp_path), train_dataset=prompts(),
        environment_factory=ScorelessEnv,
    )


def test_a_loop_whose_rollouts_carry_a_reward_needs_no_other_source():
    from asyncgrpo.train.inputs import check_prompt_source

    # HarnessAsyncGRPOTrainer's loop: no reward_funcs, no environment, the harness's reward
    check_prompt_source([], prompts(), None, max_steps=1, rollout_reward=True)
    check_prompt_source([], prompts(), ScorelessEnv, max_steps=1, rollout_reward=True)
