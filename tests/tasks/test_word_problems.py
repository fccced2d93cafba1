"""Tests for asyncgrpo.tasks.word_problems: seeded generation, reference chains, GSM8K export."""

import ast
import json
import random
import re
from pathlib import Path
from typing import Any

import pytest

from asyncgrpo.tasks import arithmetic, word_problems

_STEP = r"(\d+) ([-+*/]) (\d+) = (\d+)"
_OPS = {"+": lambda x, y: x + y, "-": lambda x, y: x - y, "*": lambda x, y: x * y, "/": lambda x, y: x / y}


def _steps(solution: str) -> list[tuple[int, str, int, int]]:
    return [(int(x), op, int(y), int(z)) for x, op, y, z in re.findall(_STEP, solution)]


def _one_gpu_to_prompt():
    """examples/one_gpu.py's ``to_prompt`` (and its INSTRUCTION), compiled on their own: importing the
    example imports the trainer and torch, which takes seconds."""
    path = Path(__file__).resolve().parents[2] / "examples" / "one_gpu.py"
    tree = ast.parse(path.read_text())

    def is_wanted(node: ast.stmt) -> bool:
        if isinstance(node, ast.FunctionDef):
            return node.name == "to_prompt"
        names = [getattr(target, "id", None) for target in getattr(node, "targets", ())]
        return isinstance(node, ast.Assign) and names == ["INSTRUCTION"]

    wanted = [node for node in tree.body if is_wanted(node)]
    assert len(wanted) == 2, "examples/one_gpu.py no longer defines INSTRUCTION and to_prompt"
    namespace: dict[str, Any] = {"Any": Any}
    code = compile(ast.Module(body=wanted, type_ignores=[]), str(path), "exec")
    exec(code, namespace)  # noqa: S102 -- the example's own two definitions, from the repository
    return namespace["to_prompt"], namespace["INSTRUCTION"]


def test_word_problems_are_deterministic_per_seed():
    assert word_problems.make_dataset(200, seed=3) == word_problems.make_dataset(200, seed=3)
    assert word_problems.make_dataset(200, seed=3) != word_problems.make_dataset(200, seed=4)
    assert word_problems.make_row("buy_change", random.Random(1)) == word_problems.make_row(
        "buy_change", random.Random(1))


def test_every_kind_appears_with_its_number_of_steps():
    rows = word_problems.make_dataset(2000, seed=0)
    assert {r["kind"] for r in rows} == set(word_problems.PROBLEM_KINDS)
    assert 15 <= len(word_problems.PROBLEM_KINDS) <= 25
    for row in rows:
        assert len(_steps(row["solution"])) == word_problems.PROBLEM_KINDS[row["kind"]][1]


def test_rows_are_conversational_questions_without_an_answer_instruction():
    for row in word_problems.make_dataset(300, seed=2):
        assert row["prompt"] == [{"role": "user", "content": row["question"]}]
        assert row["question"].endswith("?")
        assert "boxed" not in row["question"] and "answer" not in row["question"].lower()


def test_answers_are_non_negative_integers_within_the_bounds():
    rows = word_problems.make_dataset(3000, seed=5)
    for row in rows:
        assert re.fullmatch(r"\d+", row["answer"]), row["answer"]
        assert 0 <= int(row["answer"]) <= word_problems.MAX_RESULT
        for _, _, _, result in _steps(row["solution"]):
            assert 0 <= result <= word_problems.MAX_RESULT
        for number in re.findall(r"\d+", row["question"]):
            assert int(number) <= word_problems.MAX_NUMBER_IN_QUESTION, row["question"]
    # sized for a small model: most answers are small
    assert sum(int(r["answer"]) < 100 for r in rows) > 0.9 * len(rows)


def test_the_answer_is_what_the_solution_chain_computes_step_by_step():
    for row in word_problems.make_dataset(3000, seed=1):
        solution = row["solution"]
        assert re.fullmatch(rf"{_STEP}(, {_STEP})*\. \\boxed\{{\d+\}}", solution), solution
        steps = _steps(solution)
        for x, op, y, z in steps:
            assert _OPS[op](x, y) == z, (row["question"], solution)  # plain reference computation
        assert steps[-1][3] == int(row["answer"])
        assert arithmetic.extract_boxed(solution) == row["answer"]
        assert word_problems.is_correct(solution, row["answer"])


def test_questions_mention_every_number_the_chain_uses():
    for row in word_problems.make_dataset(3000, seed=6):
        mentioned = {int(n) for n in re.findall(r"\d+", row["question"])}
        implied = {2} if "twice" in row["question"] else set()
        results: set[int] = set()
        operands: set[int] = set()
        for x, _, y, z in _steps(row["solution"]):
            for operand in (x, y):
                assert operand in mentioned | implied | results, (row["question"], row["solution"])
            operands |= {x, y}
            results.add(z)
        assert mentioned <= operands, (row["question"], row["solution"])  # no number goes unused


def test_exclude_keeps_held_out_questions_out():
    held_out = {r["question"] for r in word_problems.make_dataset(300, seed=7)}
    rows = word_problems.make_dataset(3000, seed=7, exclude=held_out)
    assert len(rows) == 3000
    assert not {r["question"] for r in rows} & held_out
    assert not {r["prompt"][0]["content"] for r in rows} & held_out


def test_exclude_that_holds_every_question_raises():
    class Everything(set):
        def __contains__(self, item: object) -> bool:
            return True

    with pytest.raises(ValueError, match="nothing is left to draw"):
        word_problems.make_dataset(1, seed=0, exclude=Everything())
    assert word_problems.make_dataset(0, seed=0, exclude=Everything()) == []


def test_bad_arguments_name_the_fix():
    with pytest.raises(ValueError, match="n must be >= 0"):
        word_problems.make_dataset(-1, seed=0)
    with pytest.raises(ValueError, match="PROBLEM_KINDS"):
        word_problems.make_row("fractions", random.Random(0))


def test_is_correct_follows_arithmetics_rules():
    assert word_problems.is_correct is arithmetic.is_correct
    assert word_problems.is_correct("5 * 3 = 15, 15 + 4 = 19. \\boxed{19}", "19")
    assert word_problems.is_correct("\\boxed{ 19 }", 19)
    assert not word_problems.is_correct("the answer is 19", "19")
    assert not word_problems.is_correct("\\boxed{19.0}", "19")
    assert not word_problems.is_correct("\\boxed{$19}", "19")
    assert not word_problems.is_correct("\\boxed{19} no, \\boxed{18}", "19")


def test_gsm8k_export_round_trips_through_the_one_gpu_recipe():
    to_prompt, instruction = _one_gpu_to_prompt()
    for row in word_problems.make_dataset(200, seed=8):
        exported = json.loads(json.dumps(word_problems.to_gsm8k(row)))  # as a --data-files line
        assert set(exported) == {"question", "answer"}
        lines = exported["answer"].split("\n")
        assert lines[-1] == f"#### {row['answer']}"
        assert [_steps(line)[0] for line in lines[:-1]] == _steps(row["solution"])
        assert to_prompt(exported, "") == {"prompt": row["prompt"], "answer": row["answer"]}
        recipe = to_prompt(exported)
        assert recipe["answer"] == row["answer"]
        assert recipe["prompt"][0]["content"] == f"{row['question']}\n\n{instruction}"
