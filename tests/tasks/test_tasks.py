"""Tests for asyncgrpo.tasks: seeded generators, reference solutions and checkers."""

import math
import pickle
import re

import pytest
from transformers.utils import get_json_schema

from asyncgrpo.tasks import arithmetic, counter

# ------------------------------------------------------------------------------------------ arithmetic


def test_arithmetic_dataset_is_deterministic_per_seed():
    assert arithmetic.make_dataset(50, seed=3) == arithmetic.make_dataset(50, seed=3)
    assert arithmetic.make_dataset(50, seed=3) != arithmetic.make_dataset(50, seed=4)


def test_arithmetic_rows_are_conversational_with_the_true_answer():
    rows = arithmetic.make_dataset(500, seed=0)
    for row in rows:
        assert len(row["prompt"]) == 1 and row["prompt"][0]["role"] == "user"
        match = re.fullmatch(r"What is (\d+) ([-+*]) (\d+)\?", row["prompt"][0]["content"])
        assert match, row["prompt"][0]["content"]
        a, op, b = int(match[1]), match[2], int(match[3])
        expected = {"+": a + b, "-": a - b, "*": a * b}[op]  # plain reference computation
        assert row["answer"] == str(expected)
        assert expected >= 0
        assert row["kind"] in arithmetic.PROBLEM_KINDS
    assert {r["kind"] for r in rows} == set(arithmetic.PROBLEM_KINDS)


def test_arithmetic_reference_chains_are_correct_step_by_step():
    for row in arithmetic.make_dataset(500, seed=1):
        solution = row["solution"]
        assert arithmetic.is_correct(solution, row["answer"])
        steps = re.findall(r"(\d+) ([-+*]) (\d+) = (\d+)", solution)
        assert 1 <= len(steps) <= 3
        for x, op, y, z in steps:
            assert {"+": int(x) + int(y), "-": int(x) - int(y), "*": int(x) * int(y)}[op] == int(z)
        assert steps[-1][3] == row["answer"]


def test_solve_splits_two_digit_operands_into_tens_and_units():
    assert arithmetic.solve(37, "+", 48) == (85, "37 + 40 = 77, 77 + 8 = 85. \\boxed{85}")
    assert arithmetic.solve(84, "-", 37) == (47, "84 - 30 = 54, 54 - 7 = 47. \\boxed{47}")
    assert arithmetic.solve(24, "*", 7) == (168, "20 * 7 = 140, 4 * 7 = 28, 140 + 28 = 168. \\boxed{168}")
    assert arithmetic.solve(37, "+", 8) == (45, "37 + 8 = 45. \\boxed{45}")
    assert arithmetic.solve(37, "+", 40) == (77, "37 + 40 = 77. \\boxed{77}")
    with pytest.raises(ValueError, match="unknown operation"):
        arithmetic.solve(1, "/", 2)


def test_is_correct_accepts_the_right_boxed_integer_only():
    assert arithmetic.is_correct("so 37 + 48 = 85. \\boxed{85}", "85")
    assert arithmetic.is_correct("\\boxed{ 85 }", 85)
    assert not arithmetic.is_correct("\\boxed{84}", "85")
    assert not arithmetic.is_correct("the answer is 85", "85")
    assert not arithmetic.is_correct("\\boxed{85.0}", "85")
    assert not arithmetic.is_correct("\\boxed{eighty-five}", "85")
    assert not arithmetic.is_correct("\\boxed{85} no, \\boxed{84}", "85")  # the last box counts
    assert arithmetic.is_correct("\\boxed{84} no, \\boxed{85}", "85")


def test_extract_boxed_returns_last_box_or_none():
    assert arithmetic.extract_boxed("a \\boxed{1} b \\boxed{ 22 }") == "22"
    assert arithmetic.extract_boxed("no box") is None


def test_arithmetic_exclude_keeps_held_out_questions_out():
    held_out = {r["prompt"][0]["content"] for r in arithmetic.make_dataset(200, seed=7)}
    rows = arithmetic.make_dataset(3000, seed=8, exclude=held_out)
    assert len(rows) == 3000
    assert not {r["prompt"][0]["content"] for r in rows} & held_out


def test_arithmetic_small_model_kinds_draw_every_kind_with_true_answers_and_keep_held_out_out():
    kinds = arithmetic.SMALL_MODEL_KINDS
    held_out = {r["prompt"][0]["content"] for r in arithmetic.make_dataset(200, seed=7, kinds=kinds)}
    rows = arithmetic.make_dataset(2000, seed=8, exclude=held_out, kinds=arithmetic.SMALL_MODEL_KINDS)
    assert {r["kind"] for r in rows} == set(arithmetic.SMALL_MODEL_KINDS)
    assert not {r["prompt"][0]["content"] for r in rows} & held_out
    for row in rows:
        a, op, b = re.fullmatch(r"What is (\d+) ([-+*]) (\d+)\?", row["prompt"][0]["content"]).groups()
        assert row["answer"] == str({"+": int(a) + int(b), "-": int(a) - int(b), "*": int(a) * int(b)}[op])
        _, kind_op, (a_lo, a_hi), (b_lo, b_hi) = arithmetic.SMALL_MODEL_KINDS[row["kind"]]
        assert op == kind_op and a_lo <= int(a) <= a_hi and b_lo <= int(b) <= b_hi


def test_arithmetic_refuses_an_exclude_that_leaves_nothing_and_a_bad_kind():
    kinds = {"add_single": (1.0, "+", (1, 2), (1, 2))}
    everything = {f"What is {a} + {b}?" for a in (1, 2) for b in (1, 2)}
    assert len(arithmetic.make_dataset(5, seed=0, exclude=everything - {"What is 1 + 1?"}, kinds=kinds)) == 5
    with pytest.raises(ValueError, match="nothing is left to draw"):
        arithmetic.make_dataset(1, seed=0, exclude=everything, kinds=kinds)
    with pytest.raises(ValueError, match="operation must be"):
        arithmetic.make_dataset(1, seed=0, kinds={"div": (1.0, "/", (1, 9), (1, 9))})


# --------------------------------------------------------------------------------------------- counter


def test_counter_dataset_is_deterministic_and_in_range():
    rows = counter.make_dataset(300, seed=5)
    assert rows == counter.make_dataset(300, seed=5)
    assert rows != counter.make_dataset(300, seed=6)
    for row in rows:
        assert row["prompt"][0]["role"] == "user"
        assert str(row["target"]) in row["prompt"][0]["content"]
        assert counter.TARGET_RANGE[0] <= row["target"] <= counter.TARGET_RANGE[1]
        assert counter.MAX_STEP_RANGE[0] <= row["max_step"] <= counter.MAX_STEP_RANGE[1]
        assert math.ceil(row["target"] / row["max_step"]) <= counter.MAX_CALLS


def test_reference_messages_solve_the_task_in_the_environment():
    for row in counter.make_dataset(200, seed=9):
        env = counter.IncrementEnv()
        assert env.reset(**{k: v for k, v in row.items() if k != "prompt"}) is None
        messages = counter.reference_messages(row["target"], row["max_step"])
        for msg in messages:
            if msg["role"] == "assistant" and msg.get("tool_calls"):
                (call,) = msg["tool_calls"]
                result = env.increment(**call["function"]["arguments"])
            elif msg["role"] == "tool":
                assert msg["content"] == str(result)
        assert env.get_reward() == 1.0
        assert messages[-1] == {"role": "assistant", "content": counter.final_message(row["target"])}
        assert sum(1 for m in messages if m["role"] == "tool") == math.ceil(row["target"] / row["max_step"])


def test_increment_env_rewards_only_the_exact_target():
    env = counter.IncrementEnv()
    env.reset(target=7)
    assert env.increment(5) == 5 and env.get_reward() == 0.0
    assert env.increment(2) == 7 and env.get_reward() == 1.0
    assert env.increment(1) == 8 and env.get_reward() == 0.0
    env.reset(target=3)
    assert env.counter == 0 and env.get_reward() == 0.0


def test_increment_env_enforces_the_step_limit_and_integer_steps():
    env = counter.IncrementEnv()
    env.reset(target=10, max_step=4)
    with pytest.raises(ValueError, match="between 1 and 4"):
        env.increment(5)
    with pytest.raises(ValueError, match="between 1 and 4"):
        env.increment(0)
    with pytest.raises(TypeError, match="integer"):
        env.increment("3")
    assert env.counter == 0


def test_increment_env_self_samples_a_task_when_given_no_target():
    env_a, env_b = counter.IncrementEnv(seed=1), counter.IncrementEnv(seed=1)
    prompt = env_a.reset()
    assert prompt == env_b.reset()
    assert prompt == counter.user_message(env_a.target, env_a.max_step)


def test_increment_env_pickles_with_its_state():
    env = counter.IncrementEnv(seed=2)
    env.reset(target=9, max_step=3)
    env.increment(3)
    clone = pickle.loads(pickle.dumps(env))
    assert (clone.counter, clone.target, clone.max_step) == (3, 9, 3)
    assert clone.reset() == env.reset()  # the generator state travels too


def test_increment_tool_schema_comes_from_its_docstring():
    schema = get_json_schema(counter.IncrementEnv().increment)
    fn = schema["function"]
    assert fn["name"] == "increment"
    assert fn["description"] == "Increment the internal counter."
    assert fn["parameters"]["properties"] == {
        "step": {"type": "integer", "description": "Value to add to the counter."}
    }
    assert fn["parameters"]["required"] == ["step"]
