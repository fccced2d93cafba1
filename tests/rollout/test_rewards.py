import asyncio
import concurrent.futures
import functools
import logging
import math
import threading

import numpy as np
import pytest

from asyncgrpo.rewards import (
    accuracy_reward,
    boxed_format_reward,
    boxed_number_format_reward,
    think_format_reward,
)
from asyncgrpo.rollout.rewards import (
    RewardFunctionError,
    check_reward_signatures,
    reward_func_names,
    score_group,
    sum_rewards,
)
from asyncgrpo.types import RolloutGroup


def make_group(n=3, reward_kwargs=None, env_rewards=None, rollout_rewards=None):
    return RolloutGroup(
        prompts=[[{"role": "user", "content": "q"}]] * n,
        reward_kwargs=reward_kwargs if reward_kwargs is not None else {"answer": ["4"] * n},
        completions=[[{"role": "assistant", "content": f"c{i}"}] for i in range(n)],
        completions_ids=[[i, i + 1] for i in range(n)],
        completions_sequences=[[] for _ in range(n)],
        tool_call_counts=[0] * n,
        tool_failure_counts=[0] * n,
        model_version=0,
        group_id=0,
        row_index=0,
        env_rewards=env_rewards if env_rewards is not None else [None] * n,
        rollout_rewards=rollout_rewards if rollout_rewards is not None else [None] * n,
    )


def score(group, funcs):
    return asyncio.run(score_group(group, funcs))


def length_reward(completion_ids, **kwargs):
    return [float(len(ids)) for ids in completion_ids]


def test_functions_receive_the_seed_kwargs():
    seen = {}

    def spy(prompts, completions, completion_ids, answer, **kwargs):
        seen.update(prompts=prompts, completions=completions, completion_ids=completion_ids,
                    answer=answer, rest=kwargs)
        return [0.0] * len(completions)

    group = make_group(2)
    score(group, [spy])
    assert seen["prompts"] == group.prompts and seen["completions"] == group.completions
    assert seen["completion_ids"] == group.completions_ids and seen["answer"] == ["4", "4"]
    assert seen["rest"] == {}


def test_sync_and_async_functions_run_concurrently():
    sync_started, async_started = threading.Event(), threading.Event()

    def sync_reward(completions, **kwargs):
        sync_started.set()
        assert async_started.wait(5), "the async reward never ran while the sync one was running"
        return [1.0] * len(completions)

    async def async_reward(completions, **kwargs):
        async_started.set()
        for _ in range(500):
            if sync_started.is_set():
                break
            await asyncio.sleep(0.01)
        assert sync_started.is_set()
        return [2.0] * len(completions)

    result = score(make_group(2), [sync_reward, async_reward])
    np.testing.assert_array_equal(result.totals, [3.0, 3.0])


def test_none_means_not_applicable_and_unscored_rollouts_are_nan():
    def math_reward(completions, **kwargs):
        return [1.0, None, None, 0.0]

    async def code_reward(completions, **kwargs):
        return [None, -1.0, None, 2.0]

    result = score(make_group(4), [math_reward, code_reward])
    np.testing.assert_array_equal(result.totals, [1.0, -1.0, np.nan, 2.0])
    np.testing.assert_array_equal(result.per_source["math_reward"], [1.0, np.nan, np.nan, 0.0])
    np.testing.assert_array_equal(result.per_source["code_reward"], [np.nan, -1.0, np.nan, 2.0])


def test_environment_and_rollout_rewards_are_sources():
    class CounterEnv:
        pass

    group = make_group(3, env_rewards=[(CounterEnv, 1.0), None, (CounterEnv, 0.0)],
                       rollout_rewards=[0.5, None, None])
    result = score(group, [])
    np.testing.assert_array_equal(result.totals, [1.5, np.nan, 0.0])
    np.testing.assert_array_equal(result.per_source["CounterEnv"], [1.0, np.nan, 0.0])
    result = score(group, [length_reward])
    np.testing.assert_array_equal(result.totals, [3.5, 2.0, 2.0])


def test_length_mismatch_names_the_function():
    def short_reward(completions, **kwargs):
        return [1.0]

    with pytest.raises(ValueError, match="'short_reward' returned 1 values for 3 completions"):
        score(make_group(3), [short_reward])


@pytest.mark.parametrize("bad", [1.0, "1.0", {"a": 1.0}, ["x", 1.0, 1.0]])
def test_bad_return_values_name_the_function(bad):
    def odd_reward(completions, **kwargs):
        return bad

    with pytest.raises(TypeError, match="'odd_reward'"):
        score(make_group(3), [odd_reward])


def test_a_raising_function_is_named_and_chained():
    def broken_reward(completions, **kwargs):
        raise KeyError("solution")

    with pytest.raises(RewardFunctionError, match="'broken_reward' raised KeyError") as info:
        score(make_group(2), [broken_reward])
    assert isinstance(info.value.__cause__, KeyError)


def test_a_reward_function_that_cannot_take_a_calls_keywords_is_refused_before_training():
    """Checked against what every call passes: prompts, completions, completion_ids and the dataset's
    columns but the prompt (unknown for some streaming datasets: then only the first three)."""

    def no_kwargs(completions):
        return [0.0] * len(completions)

    def needs_a_column(completions, solution, **kwargs):
        return [0.0] * len(completions)

    def every_keyword(prompts, completions, completion_ids, answer):
        return [0.0] * len(completions)

    columns = ["prompt", "answer"]
    check_reward_signatures([length_reward, every_keyword, accuracy_reward,
                             functools.partial(length_reward)], columns)
    with pytest.raises(TypeError,
                       match=r"'no_kwargs' does not take the keyword\(s\) \['prompts', 'completion_ids', "
                                        r"'answer'\]; .*end the signature with \*\*kwargs"):
        check_reward_signatures([no_kwargs], columns)
    with pytest.raises(TypeError, match=r"'needs_a_column' requires \['solution'\], which no call passes: .*"
                                        r"columns \['answer'\]"):
        check_reward_signatures([needs_a_column], columns)
    check_reward_signatures([needs_a_column], None)  # the columns are unknown: its **kwargs may hold it
    with pytest.raises(TypeError, match="does not take"):
        check_reward_signatures([no_kwargs], None)


def test_a_keyword_a_function_does_not_take_says_to_add_kwargs():
    def no_kwargs(completions, answer):
        return [0.0] * len(completions)

    with pytest.raises(RewardFunctionError,
                       match=r"unexpected keyword argument.*end the signature with \*\*kwargs"):
        score(make_group(2), [no_kwargs])


def test_dataset_columns_that_clash_with_reward_arguments_are_rejected():
    with pytest.raises(ValueError, match="completions"):
        score(make_group(2, reward_kwargs={"completions": [1, 2]}), [length_reward])


class Scaled:
    def __call__(self, completions, **kwargs):
        return [1.0] * len(completions)


class AsyncJudge:
    async def __call__(self, completions, **kwargs):
        await asyncio.sleep(0)
        return [0.25] * len(completions)


def test_callable_instances_with_async_call_are_awaited():
    np.testing.assert_array_equal(score(make_group(2), [AsyncJudge(), Scaled()]).totals, [1.25, 1.25])


def test_names_of_partials_instances_and_duplicates():
    names = reward_func_names([length_reward, functools.partial(length_reward), Scaled(), length_reward])
    assert names == ["length_reward", "length_reward_1", "Scaled", "length_reward_2"]


def test_sum_rewards_reference():
    sources = [np.array([1.0, np.nan, np.nan]), np.array([2.0, 3.0, np.nan])]
    np.testing.assert_array_equal(sum_rewards(sources, 3), [3.0, 3.0, np.nan])
    assert np.isnan(sum_rewards([], 2)).all()


# -- bundled reward functions ---------------------------------------------------------------------

def says(text):
    return [{"role": "assistant", "content": text}]


def test_accuracy_reward_accepts_equivalent_boxed_forms():
    pytest.importorskip("math_verify")
    completions = [says(r"so \boxed{0.5}"), says(r"\boxed{\frac{1}{2}}"), says(r"\boxed{0.25}"), says("1/2")]
    assert accuracy_reward(completions, solution=["1/2"] * 4) == [1.0, 1.0, 0.0, 0.0]
    assert accuracy_reward([says(r"\boxed{\dfrac{1}{2}}")], solution=["0.5"]) == [1.0]


def test_accuracy_reward_gold_sources():
    pytest.importorskip("math_verify")
    worked = r"37 + 40 = 77, 77 + 8 = 85. \boxed{85}"
    assert accuracy_reward([says(r"\boxed{85}")], solution=[worked]) == [1.0]
    assert accuracy_reward([says(r"\boxed{85}")], answer=["85"]) == [1.0]
    assert accuracy_reward([says(r"\boxed{85}")], solution=["no number here"], answer=["85"]) == [1.0]
    assert accuracy_reward([says(r"\boxed{85}")], solution=["no number here"]) == [None]
    with pytest.raises(ValueError, match="'solution'"):
        accuracy_reward([says("x")])


def test_accuracy_reward_reads_the_last_assistant_message():
    pytest.importorskip("math_verify")
    completion = [
        {"role": "assistant", "content": r"\boxed{3}", "tool_calls": []},
        {"role": "tool", "content": "4"},
        {"role": "assistant", "content": r"The count is \boxed{4}"},
    ]
    assert accuracy_reward([completion], answer=["4"]) == [1.0]


def test_accuracy_reward_is_thread_safe():
    pytest.importorskip("math_verify")
    completions = [says(rf"\boxed{{{i}}}") for i in range(8)]
    golds = [str(i if i % 2 else i + 1) for i in range(8)]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda k: accuracy_reward(completions, answer=golds), range(4)))
    assert all(r == [0.0 if i % 2 == 0 else 1.0 for i in range(8)] for r in results)


def test_accuracy_reward_through_score_group_threads():
    pytest.importorskip("math_verify")
    group = make_group(2, reward_kwargs={"answer": ["4", "4"]})
    group.completions = [says(r"\boxed{4}"), says(r"\boxed{5}")]
    np.testing.assert_array_equal(score(group, [accuracy_reward]).totals, [1.0, 0.0])


def test_think_format_reward():
    completions = [
        says("<think>\nreasoning\n</think>\nanswer"),
        says("<think>\nno closing tag"),
        says("answer <think>late</think>"),
        [{"role": "assistant", "content": "4", "reasoning_content": "2+2"}],
    ]
    assert think_format_reward(completions) == [1.0, 0.0, 0.0, 1.0]


def test_boxed_format_reward():
    completions = [says(r"so \boxed{\frac{1}{2}}"), says("1/2"),
                   says(r"\boxed{1} or \boxed{2}"), says(r"\boxed{}"), says(r"\boxed{3")]
    assert boxed_format_reward(completions) == [1.0, 0.0, 0.0, 0.0, 0.0]
    assert not math.isnan(boxed_format_reward(["plain \\boxed{2}"])[0])


def test_boxed_number_format_reward_takes_one_box_holding_a_plain_number_only():
    numbers = [r"\boxed{8}", r"3 + 5 = 8. \boxed{ 8 }", r"\boxed{-12}", r"\boxed{1,234}",
               r"\boxed{+0.5}", r"\boxed{.5}"]
    others = [r"\boxed{number}", r"\boxed{}", r"\boxed{3 + 5}",
              r"\boxed{\frac{1}{2}}", r"\boxed{8} \boxed{8}", r"\boxed{12,34}", "8", r"\boxed{8"]
    assert boxed_number_format_reward([says(t) for t in numbers]) == [1.0] * len(numbers)
    assert boxed_number_format_reward([says(t) for t in others]) == [0.0] * len(others)


def test_accuracy_reward_hides_math_verify_notice_about_disabled_timeouts(caplog):
    pytest.importorskip("math_verify")
    import math_verify.grader
    import math_verify.parser

    math_verify.grader.TIMEOUT_WARNING_SHOWN = False  # the notice is shown once per process
    math_verify.parser.TIMEOUT_WARNING_SHOWN = False
    with caplog.at_level(logging.WARNING):
        assert accuracy_reward([[{"role": "assistant", "content": r"\boxed{4}"}]], answer=["4"]) == [1.0]
    assert not [r for r in caplog.records if "Timeout is disabled" in r.getMessage()]


def test_reward_models_are_refused_where_the_trainer_is_built():
    """The specification: reward models given as a model id or a PreTrainedModel are not supported. A
    model is callable, so callable() alone let one through to the first group's scoring."""
    import torch

    from asyncgrpo.train.inputs import reward_func_list

    assert reward_func_list([length_reward]) == [length_reward]
    for model in ("some-org/reward-model", torch.nn.Linear(2, 1)):
        with pytest.raises(TypeError,
                           match=r"reward_funcs\[1\] is a \w+, not a reward function; reward models"):
            reward_func_list([length_reward, model])


def test_without_a_dataset_a_reward_gets_no_column_to_ask_for():
    """An environment that makes its own prompts (no train_dataset): each call passes prompts, completions
    and completion_ids only."""
    from asyncgrpo.tasks.counter import IncrementEnv
    from asyncgrpo.train.inputs import check_prompt_source

    def needs_target(completions, target, **kwargs):
        return [0.0] * len(completions)

    check_prompt_source([length_reward], None, IncrementEnv, max_steps=3)
    with pytest.raises(TypeError, match=r"'needs_target' requires \['target'\], which no call passes"):
        check_prompt_source([needs_target], None, IncrementEnv, max_steps=3)
