r"""`accuracy_reward`: math answers checked with math-verify.

The gold answer comes from the dataset's `solution` column (as in TRL), or `answer` when there is no
`solution` (or a row's `solution` cannot be parsed). It is parsed `\boxed{}` first, then as LaTeX or a
plain expression, so "85", "\frac{1}{2}" and a worked solution ending in "\boxed{85}" all work. The
completion's final answer (its last assistant message) must be in LaTeX, `\boxed{}` tried first;
equivalent forms match (`\boxed{0.5}` is right for a gold of `1/2`).

Values: 1.0 right, 0.0 wrong (an unparseable answer is wrong), None when the gold cannot be parsed,
which excludes the rollout from this reward (None semantics of the reward sum).

math-verify guards parsing with SIGALRM-based timeouts, which only work in a process's main thread;
reward functions run in worker threads, so timeouts are disabled here (and math-verify's one-time
warning about it is filtered out). Keep completions bounded (`max_completion_length`) to bound
parsing time.
"""

from __future__ import annotations

import logging
from functools import lru_cache
from typing import Any

from asyncgrpo.rewards.format import last_assistant_text


def _drop_disabled_timeout_notice(record: logging.LogRecord) -> bool:
    """Logging filter: math-verify's notice that timeouts are off (they are off on purpose, see above)."""
    return not record.getMessage().startswith("Timeout is disabled")


@lru_cache(maxsize=1)
def _math_verify() -> tuple[Any, Any, list[Any], list[Any]]:
    """Import math-verify on first use: (parse, verify, gold config, answer config)."""
    try:
        from latex2sympy2_extended import NormalizationConfig
        from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify
    except ImportError as exc:
        raise ImportError(
            "accuracy_reward needs math-verify: pip install 'asyncgrpo[math]' (or pip install math-verify)"
        ) from exc
    for name in ("math_verify.grader", "math_verify.parser"):
        logging.getLogger(name).addFilter(_drop_disabled_timeout_notice)
    gold_config = [LatexExtractionConfig(boxed_match_priority=0), ExprExtractionConfig()]
    answer_config = [
        LatexExtractionConfig(
            normalization_config=NormalizationConfig(
                nits=False, malformed_operators=False, basic_latex=True, boxed="all", units=True
            ),
            boxed_match_priority=0,
            try_extract_without_anchor=False,
        )
    ]
    return parse, verify, gold_config, answer_config


def _parse(text: str, config: list[Any]) -> list[Any]:
    parse, _, _, _ = _math_verify()
    return parse(text, extraction_config=config, extraction_mode="first_match", parsing_timeout=None)


def _parse_gold(*candidates: Any) -> list[Any]:
    _, _, gold_config, _ = _math_verify()
    for gold in candidates:
        if gold is None:
            continue
        parsed = _parse(str(gold), gold_config)
        if parsed:
            return parsed
    return []


def score_answer(completion: Any, solution: Any = None, answer: Any = None) -> float | None:
    """Accuracy of one completion against its gold (`solution`, else `answer`); see the module doc."""
    _, verify, _, answer_config = _math_verify()
    gold = _parse_gold(solution, answer)
    if not gold:
        return None
    predicted = _parse(last_assistant_text(completion), answer_config)
    # verify() catches comparison errors itself (raise_on_error=False) and answers False
    return float(verify(gold, predicted, timeout_seconds=None))


def accuracy_reward(
    completions: list[Any],
    solution: list[Any] | None = None,
    answer: list[Any] | None = None,
    **kwargs: Any,
) -> list[float | None]:
    r"""1.0 when a completion's final answer equals the gold answer, 0.0 when not, None if unparseable.

    Args:
        completions: Conversational completions (lists of message dicts).
        solution: Gold solutions, one per completion (a dataset column), e.g. "\frac{1}{3}".
        answer: Gold answers, used where `solution` is missing or unparseable.
        **kwargs: The other reward-function arguments, unused.

    Example:
        >>> accuracy_reward([[{"role": "assistant", "content": r"so \boxed{0.5}"}]], solution=["1/2"])
        [1.0]
    """
    if solution is None and answer is None:
        raise ValueError(
            "accuracy_reward needs the gold answers: give the dataset a 'solution' (or 'answer') column"
        )
    n = len(completions)
    solutions = solution if solution is not None else [None] * n
    answers = answer if answer is not None else [None] * n
    if len(solutions) != n or len(answers) != n:
        raise ValueError(
            f"accuracy_reward got {n} completions but {len(solutions)} solutions / {len(answers)} answers; "
            f"give one gold per completion"
        )
    return [score_answer(c, s, a) for c, s, a in zip(completions, solutions, answers)]
