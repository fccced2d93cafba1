"""Arithmetic task: seeded two-operand problems answered with a short chain and ``\\boxed{}``.

A row is ``{"prompt": [{"role": "user", "content": "What is 37 + 48?"}], "answer": "85",
"solution": "37 + 40 = 77, 77 + 8 = 85. \\boxed{85}", "kind": "add_2digit"}``. ``prompt`` is
conversational (what the trainer renders with the chat template), ``answer`` is the exact integer as
a string (what a reward function compares against), ``solution`` is the reference completion the
bundled tiny model was trained on and ``kind`` names the entry of ``PROBLEM_KINDS`` it was drawn
from. Everything here is pure: the same ``(n, seed)`` always gives the same rows.
"""

from __future__ import annotations

import random
import re

__all__ = [
    "PROBLEM_KINDS",
    "SMALL_MODEL_KINDS",
    "extract_boxed",
    "is_correct",
    "make_dataset",
    "make_row",
    "solve",
]

PROBLEM_KINDS: dict[str, tuple[float, str, tuple[int, int], tuple[int, int]]] = {
    # name: (relative frequency, op, range of a, range of b); ranges inclusive
    "add_1digit": (0.20, "+", (1, 99), (1, 9)),
    "sub_1digit": (0.20, "-", (10, 99), (1, 9)),
    "add_2digit": (0.20, "+", (10, 99), (10, 99)),
    "sub_2digit": (0.20, "-", (20, 99), (10, 99)),
    "mul_2digit": (0.20, "*", (10, 99), (2, 9)),
}
"""Problem kinds and how often each is drawn. Subtraction draws b from [b_lo, min(b_hi, a)] so that
answers are never negative. The mix of one-step and multi-step kinds keeps the tiny model partially
right; changing it changes the model's success rate."""

SMALL_MODEL_KINDS: dict[str, tuple[float, str, tuple[int, int], tuple[int, int]]] = {
    "add_single": (0.20, "+", (1, 9), (1, 9)),
    "mul_single": (0.20, "*", (2, 9), (2, 9)),
    "add_1digit": (0.20, "+", (10, 99), (1, 9)),
    "sub_1digit": (0.20, "-", (10, 99), (1, 9)),
    "add_2digit": (0.20, "+", (10, 99), (10, 99)),
}
"""An easier mix for small pretrained models (SmolLM2-135M-Instruct, `examples/real_model.py`): the
one-digit sums and products such a model often gets right, then harder kinds it mostly does not, so
that RL has both a signal and room to improve."""

_BOXED_RE = re.compile(r"\\boxed\{([^{}]*)\}")


def _step(x: int, op: str, y: int) -> tuple[int, str]:
    z = x + y if op == "+" else x - y if op == "-" else x * y
    return z, f"{x} {op} {y} = {z}"


def solve(a: int, op: str, b: int) -> tuple[int, str]:
    """Return the result of ``a op b`` and the reference chain that reaches it.

    Each step is one digit-level operation: the second operand of ``+``/``-`` and the first of
    ``*`` are split into tens and units when they have two digits, e.g.
    ``37 + 48`` -> ``37 + 40 = 77, 77 + 8 = 85. \\boxed{85}``,
    ``24 * 7`` -> ``20 * 7 = 140, 4 * 7 = 28, 140 + 28 = 168. \\boxed{168}``,
    ``37 + 8`` -> ``37 + 8 = 45. \\boxed{45}``.
    """
    if op not in ("+", "-", "*"):
        raise ValueError(f"unknown operation {op!r}; use '+', '-' or '*'")
    split = b if op in "+-" else a
    tens, units = split - split % 10, split % 10
    if split < 10 or units == 0:
        result, text = _step(a, op, b)
        steps = [text]
    elif op in "+-":
        mid, first = _step(a, op, tens)
        result, second = _step(mid, op, units)
        steps = [first, second]
    else:
        high, first = _step(tens, "*", b)
        low, second = _step(units, "*", b)
        result, third = _step(high, "+", low)
        steps = [first, second, third]
    return result, ", ".join(steps) + f". \\boxed{{{result}}}"


def make_row(a: int, op: str, b: int, kind: str | None = None) -> dict:
    """Build one dataset row (prompt, answer, solution, kind) for ``a op b``."""
    result, solution = solve(a, op, b)
    return {
        "prompt": [{"role": "user", "content": f"What is {a} {op} {b}?"}],
        "answer": str(result),
        "solution": solution,
        "kind": kind,
    }


def _draw(rng: random.Random, kinds: dict) -> tuple[str, int, str, int]:
    names = list(kinds)
    kind = rng.choices(names, weights=[kinds[k][0] for k in names])[0]
    _, op, (a_lo, a_hi), (b_lo, b_hi) = kinds[kind]
    a = rng.randint(a_lo, a_hi)
    b = rng.randint(b_lo, min(b_hi, a) if op == "-" else b_hi)
    return kind, a, op, b


def make_dataset(n: int, seed: int, exclude: set[str] | None = None, kinds: dict | None = None) -> list[dict]:
    """Return ``n`` problems drawn with ``random.Random(seed)``.

    Args:
        n: Number of rows.
        seed: Seed of the generator; the same seed gives the same rows.
        exclude: User-message texts (``"What is 37 + 48?"``) that must not appear, e.g. the
            questions of a held-out set.
        kinds: The mix to draw from, shaped like ``PROBLEM_KINDS`` (the default), e.g.
            ``SMALL_MODEL_KINDS``.

    Returns:
        Rows with ``prompt`` (list of one user message), ``answer`` and ``solution``.
    """
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    kinds = PROBLEM_KINDS if kinds is None else kinds
    for name, (weight, op, _, _) in kinds.items():
        if op not in ("+", "-", "*") or weight <= 0:
            raise ValueError(f"kind {name!r}: the operation must be '+', '-' or '*', the frequency positive; "
                             f"got {op!r} and {weight}")
    rng = random.Random(seed)
    rows: list[dict] = []
    if n and exclude is not None and len(_questions(kinds) - exclude) == 0:
        raise ValueError(f"exclude holds every one of the {len(_questions(kinds))} questions of these kinds: "
                         "nothing is left to draw")
    while len(rows) < n:
        kind, a, op, b = _draw(rng, kinds)
        row = make_row(a, op, b, kind)
        if exclude is not None and row["prompt"][0]["content"] in exclude:
            continue
        rows.append(row)
    return rows


def _questions(kinds: dict) -> set[str]:
    """Every question text the kinds can draw."""
    questions = set()
    for _, op, (a_lo, a_hi), (b_lo, b_hi) in kinds.values():
        for a in range(a_lo, a_hi + 1):
            for b in range(b_lo, (min(b_hi, a) if op == "-" else b_hi) + 1):
                questions.add(f"What is {a} {op} {b}?")
    return questions


def extract_boxed(text: str) -> str | None:
    """Return the content of the last ``\\boxed{...}`` in ``text`` (stripped), or None."""
    matches = _BOXED_RE.findall(text)
    return matches[-1].strip() if matches else None


def is_correct(text: str, answer: str | int) -> bool:
    """Whether the last ``\\boxed{}`` of ``text`` holds exactly the integer ``answer``.

    Spaces and a leading ``+`` are tolerated (``\\boxed{ 85 }``); anything else (``85.0``,
    ``eighty-five``, a missing box) is wrong.
    """
    boxed = extract_boxed(text)
    if boxed is None:
        return False
    boxed = boxed.replace(" ", "").lstrip("+")
    return re.fullmatch(r"-?\d+", boxed) is not None and int(boxed) == int(answer)
