import dataclasses
import pickle

import numpy as np
import pytest

from asyncgrpo.types import Rollout, RolloutGroup, TrainingSequence, TurnRecord, check_turn


def make_rollout(reward=None):
    turn = TurnRecord(prompt_ids=[1, 2], output_ids=[3, 4], output_log_probs=[-0.1, -0.2])
    return Rollout(completion=[{"role": "assistant", "content": "hi"}], completion_ids=[3, 4],
                   turns=[turn], reward=reward)


def test_rollout_ids_are_fresh_random_hex():
    a, b = make_rollout(), make_rollout()
    assert a.rollout_id != b.rollout_id
    assert len(a.rollout_id) == 32
    int(a.rollout_id, 16)


def test_hooks_can_set_rollout_reward_and_group_rewards():
    rollout = make_rollout()
    rollout.reward = 0.5
    group = RolloutGroup.from_rollouts(
        [rollout, make_rollout(1.0)], [[], []], prompt=[{"role": "user", "content": "q"}],
        reward_kwargs={"answer": ["1", "1"]}, model_version=3, group_id=7, row_index=2,
    )
    group.rewards = np.array([0.5, 1.0])
    assert group.rollout_rewards == [0.5, 1.0]
    assert group.env_rewards == [None, None]
    assert len(group) == 2 and group.model_version == 3 and group.group_id == 7 and group.row_index == 2


def test_from_rollouts_checks_one_sequence_list_per_rollout():
    with pytest.raises(ValueError, match="one per rollout"):
        RolloutGroup.from_rollouts(
            [make_rollout()], [], prompt=[], reward_kwargs={}, model_version=0, group_id=0, row_index=0
        )


def test_turn_defaults_train_every_output_token():
    turn = TurnRecord(prompt_ids=[1], output_ids=[5, 6, 7])
    assert turn.output_log_probs == [] and turn.trained_flags() == [1, 1, 1]
    assert TurnRecord([1], [5, 6], [0.0, 0.0], output_mask=[1, 0]).trained_flags() == [1, 0]


def test_check_turn_names_misaligned_fields():
    with pytest.raises(ValueError, match="output_mask has 1 entries for 2 output tokens"):
        check_turn(TurnRecord([1], [5, 6], [-1.0, -1.0], output_mask=[1]))
    with pytest.raises(ValueError, match="output_log_probs"):
        check_turn(TurnRecord([1], [5, 6]))
    check_turn(TurnRecord([1], [5, 6], output_mask=[0, 0]))  # context only: no log-probs needed


def test_training_sequence_is_frozen_and_counts_trained_tokens():
    seq = TrainingSequence(token_ids=[1, 2, 3], trained_mask=[0, 1, 1], sampler_logprobs=[0.0, -0.5, -0.1])
    assert seq.num_trained_tokens == 2 and len(seq) == 3
    with pytest.raises(dataclasses.FrozenInstanceError):
        seq.token_ids = []


def test_every_record_pickles():
    turn = TurnRecord([1, 2], [3], [-0.3], output_sampling_mask=[[3, 9]],
                      output_sampler_logprobs=[{3: -0.3, 9: -1.4}])
    seq = TrainingSequence([1, 2, 3], [0, 0, 1], [0.0, 0.0, -0.3],
                           [None, None, {3: -0.3}], [None, None, [3, 9]])
    rollout = Rollout(completion=[], completion_ids=[3], turns=[turn], reward=1.0)
    group = RolloutGroup.from_rollouts(
        [rollout], [[seq]], prompt=[{"role": "user", "content": "q"}], reward_kwargs={},
        model_version=1, group_id=0, row_index=0, env_rewards=[(dict, 1.0)],
    )
    group.rewards = np.array([2.0])
    for obj in (turn, seq, rollout):
        assert pickle.loads(pickle.dumps(obj)) == obj
    clone = pickle.loads(pickle.dumps(group))
    assert clone.completions_sequences == [[seq]] and clone.env_rewards == [(dict, 1.0)]
    np.testing.assert_array_equal(clone.rewards, group.rewards)


@pytest.mark.parametrize(
    "module,names",
    [
        ("asyncgrpo", ["AsyncGRPOTrainer", "AsyncGRPOConfig", "AsyncRolloutLoop", "Rollout", "RolloutGroup",
                       "TurnRecord", "TrainingSequence"]),
        ("asyncgrpo.async_rollout_worker", ["TurnRecord", "RolloutGroup", "TrainingSequence", "Rollout",
                                            "AsyncRolloutLoop"]),
        ("asyncgrpo.async_grpo_config", ["AsyncGRPOConfig"]),
        ("asyncgrpo.async_grpo_trainer", ["AsyncGRPOTrainer"]),
    ],
)
def test_every_documented_name_imports_from_the_reference_module_path(module, names):
    # a user of the reference swaps `trl.experimental.async_grpo` for `asyncgrpo` in the import line
    import importlib

    from asyncgrpo.config import AsyncGRPOConfig
    from asyncgrpo.rollout.loop import AsyncRolloutLoop
    from asyncgrpo.train.trainer import AsyncGRPOTrainer
    from asyncgrpo.types import Rollout, RolloutGroup, TrainingSequence, TurnRecord

    defined = {c.__name__: c for c in (AsyncGRPOConfig, AsyncRolloutLoop,
                                       AsyncGRPOTrainer, Rollout, RolloutGroup, TrainingSequence, TurnRecord)}
    mod = importlib.import_module(module)
    for name in names:
        assert getattr(mod, name) is defined[name], f"{module}.{name}"
