"""Format rewards for conversational completions (lists of message dicts).

A completion is what a rollout generated after the prompt: one assistant message, or, with tools,
assistant and tool messages in turn. These rewards look at the final answer, the content of the last
assistant message. Reasoning that a chat template moved out of `content` (a `reasoning_content` or
`reasoning` field) is put back as `<think>...</think>` in front of it, so `think_format_reward` works
whichever way the reasoning was parsed.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

_THINK_PATTERN = re.compile(r"^<think>(?!.*<think>)(.*?)</think>.*$", re.DOTALL)


def _content_text(content: Any) -> str:
    """Message content as text: a string, or the text parts of a list of content parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, Sequence):
        return "".join(
            part.get("text", "") if isinstance(part, Mapping) else str(part) for part in content
        )
    return str(content)


def last_assistant_text(completion: Any) -> str:
    """Text of a completion's final answer: the last assistant message (or the last message).

    `completion` is a list of message dicts; a plain string is returned as is.
    """
    if isinstance(completion, str):
        return completion
    if isinstance(completion, Mapping):
        completion = [completion]
    if not completion:
        return ""
    messages = [m for m in completion if isinstance(m, Mapping)]
    assistant = [m for m in messages if m.get("role", "assistant") == "assistant"]
    message = (assistant or messages or [{}])[-1]
    text = _content_text(message.get("content"))
    reasoning = message.get("reasoning_content") or message.get("reasoning")
    if reasoning and "<think>" not in text:
        text = f"<think>{reasoning}</think>{text}"
    return text


def think_format_reward(completions: list[Any], **kwargs: Any) -> list[float]:
    r"""1.0 when the final answer opens with one `<think>...</think>` block, else 0.0.

    Example:
        >>> think_format_reward([[{"role": "assistant", "content": "<think>\nx\n</think>\n4"}],
        ...                      [{"role": "assistant", "content": "4"}]])
        [1.0, 0.0]
    """
    return [1.0 if _THINK_PATTERN.match(last_assistant_text(c)) else 0.0 for c in completions]


def boxed_spans(text: str) -> list[str]:
    r"""Contents of every `\boxed{...}` in `text`, with nested braces balanced; unclosed ones are skipped."""
    spans: list[str] = []
    start = text.find("\\boxed{")
    while start != -1:
        i = start + len("\\boxed{")
        depth = 1
        while i < len(text) and depth:
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            i += 1
        if depth == 0:
            spans.append(text[start + len("\\boxed{") : i - 1])
        start = text.find("\\boxed{", start + 1)
    return spans


def boxed_format_reward(completions: list[Any], **kwargs: Any) -> list[float]:
    r"""1.0 when the final answer holds exactly one non-empty, balanced `\boxed{...}`, else 0.0.

    Example:
        >>> boxed_format_reward([[{"role": "assistant", "content": "so \\boxed{\\frac{1}{2}}"}],
        ...                      [{"role": "assistant", "content": "1/2"}]])
        [1.0, 0.0]
    """
    rewards = []
    for completion in completions:
        spans = boxed_spans(last_assistant_text(completion))
        rewards.append(1.0 if len(spans) == 1 and spans[0].strip() else 0.0)
    return rewards


_NUMBER = re.compile(r"[-+]?(\d+(,\d{3})*(\.\d+)?|\.\d+)")


def boxed_number_format_reward(completions: list[Any], **kwargs: Any) -> list[float]:
    r"""1.0 when the final answer holds exactly one `\boxed{...}` and it holds a plain number, else 0.0.

    For tasks whose answers are numbers (arithmetic, GSM8K): stricter than `boxed_format_reward`, which a
    model can satisfy with a box that holds a word (`\boxed{number}`, copied from an instruction) or an
    expression. A number may carry a sign, thousands separators and decimals; spaces around it are allowed.

    Example:
        >>> boxed_number_format_reward([[{"role": "assistant", "content": "3 + 5 = 8, so \boxed{8}"}],
        ...                             [{"role": "assistant", "content": "\boxed{number}"}]])
        [1.0, 0.0]
    """
    rewards = []
    for completion in completions:
        spans = boxed_spans(last_assistant_text(completion))
        rewards.append(1.0 if len(spans) == 1 and _NUMBER.fullmatch(spans[0].strip()) else 0.0)
    return rewards
