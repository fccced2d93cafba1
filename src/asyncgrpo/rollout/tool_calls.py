"""Tool-call parsing: the text of one generated turn -> the assistant message with its `tool_calls`.

Run by the rollout process on every turn of a tool-using rollout (`asyncgrpo.rollout.generate`).
The formats are the model families' (`asyncgrpo.data.chat_templates.detect_family`): Qwen's
`<tool_call>` blocks (the default), Llama 3's bare JSON objects and DeepSeek-V3's special-token
blocks, unless the tokenizer brings its own response parser. Pure: text in, messages out.
"""

from __future__ import annotations

import json
import re
from typing import Any

from asyncgrpo.data.chat_templates import (
    DEEPSEEK_V3,
    DS_CALL_BEGIN,
    DS_CALL_END,
    DS_CALLS_BEGIN,
    DS_CALLS_END,
    DS_SEP,
    LLAMA3,
    detect_family,
)

__all__ = ["ToolCallParseError", "parse_assistant_message", "parse_tool_calls"]


class ToolCallParseError(ValueError):
    """The model wrote a tool call that does not parse.

    Attributes:
        errors: One message per malformed call, saying what was expected.
        partial: The assistant message without the malformed calls (content and the well-formed calls).
        calls: The well-formed calls, in order (`partial["tool_calls"]`, or []).
    """

    def __init__(self, errors: list[str], partial: dict[str, Any]) -> None:
        more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
        super().__init__(f"{errors[0]}{more}")
        self.errors = list(errors)
        self.partial = partial
        self.calls = list(partial.get("tool_calls", []))


QWEN_CALL_RE = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
LLAMA_CALL_START_RE = re.compile(r'\{\s*"name"\s*:')
DS_CALL_RE = re.compile(
    re.escape(DS_CALL_BEGIN) + r"(?P<type>.*?)" + re.escape(DS_SEP) + r"(?P<name>[^\n]*)\n```(?:json)?\n"
    r"(?P<args>.*?)\n```" + re.escape(DS_CALL_END),
    re.DOTALL,
)


def _tool_call(name: Any, arguments: Any, raw: str, arguments_key: str = "arguments") -> dict[str, Any]:
    """A call in the chat-template form; raises ValueError naming the expected shape."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError as exc:
            raise ValueError(f"the arguments of tool call {raw[:200]!r} are not JSON ({exc.msg})") from exc
    if not isinstance(name, str) or not name or not isinstance(arguments, dict):
        raise ValueError(
            f'a tool call must be {{"name": <string>, "{arguments_key}": <object>}}, got {raw[:200]!r}'
        )
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


def _payload_call(payload: Any, raw: str, arguments_key: str) -> dict[str, Any]:
    """A call from a decoded JSON payload `{"name": ..., arguments_key: ...}` (either key accepted)."""
    fields = payload if isinstance(payload, dict) else {}
    arguments = fields.get(arguments_key, fields.get("arguments", fields.get("parameters", {})))
    return _tool_call(fields.get("name"), arguments, raw, arguments_key)


def _split_qwen(text: str) -> tuple[str, list[dict[str, Any]], list[str]]:
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks; an unclosed block is text.

    The content is the text before the first block less the one newline the Qwen templates write before
    a call, so that re-rendering gives back what the model wrote (other text between or after the
    blocks, which the templates cannot place, is appended on its own line)."""
    matches = list(QWEN_CALL_RE.finditer(text))
    if not matches:
        return text, [], []
    calls, errors = [], []
    for match in matches:
        raw = match.group(1).strip()
        try:
            calls.append(_payload_call(json.loads(raw), raw, "arguments"))
        except json.JSONDecodeError as exc:
            errors.append(f"could not parse the tool call as JSON ({exc.msg}): {raw[:200]!r}")
        except ValueError as exc:
            errors.append(str(exc))
    content = text[: matches[0].start()].removesuffix("\n")
    between = (text[a.end() : b.start() if b else len(text)] for a, b in zip(matches, [*matches[1:], None]))
    leftovers = [piece.strip() for piece in between if piece.strip()]
    content = "\n".join([content, *leftovers]) if leftovers else content
    return content, calls, errors


def _split_llama(text: str) -> tuple[str, list[dict[str, Any]], list[str]]:
    """Bare JSON objects `{"name": ..., "parameters": {...}}` (optionally after <|python_tag|>), several
    separated by ";"; the content is the text before the first one."""
    match = LLAMA_CALL_START_RE.search(text)
    if match is None:
        return text, [], []
    content = text[: match.start()].replace("<|python_tag|>", "")
    calls, errors = [], []
    rest = text[match.start() :]
    decoder = json.JSONDecoder()
    while rest.startswith("{"):
        try:
            payload, end = decoder.raw_decode(rest)
        except json.JSONDecodeError as exc:
            errors.append(f"could not parse the tool call as JSON ({exc.msg}): {rest[:200]!r}")
            break
        try:
            calls.append(_payload_call(payload, rest[:end], "parameters"))
        except ValueError as exc:
            errors.append(str(exc))
        rest = rest[end:].lstrip().removeprefix(";").lstrip().removeprefix("<|python_tag|>")
    return (content if content.strip() else ""), calls, errors


def _split_deepseek(text: str) -> tuple[str, list[dict[str, Any]], list[str]]:
    """DeepSeek-V3's tool-calls block; the content is the text before it."""
    start = text.find(DS_CALLS_BEGIN)
    if start < 0:
        return text, [], []
    block = text[start + len(DS_CALLS_BEGIN) :].split(DS_CALLS_END)[0]
    calls, errors = [], []
    pieces = [p for p in block.split(DS_CALL_BEGIN) if p.strip()]
    for piece in pieces:
        match = DS_CALL_RE.fullmatch(DS_CALL_BEGIN + piece.rstrip("\n"))
        if match is None:
            errors.append(
                f"a DeepSeek tool call must be <tool call begin>function<tool sep>NAME\\n```json\\nARGS\\n```"
                f"<tool call end>, got {piece[:200]!r}"
            )
            continue
        try:
            calls.append(_tool_call(match.group("name").strip(), match.group("args"), piece))
        except ValueError as exc:
            errors.append(str(exc))
    return text[:start], calls, errors


def parse_assistant_message(
    tokenizer: Any, text: str, *, prefix: str = "", tools: list[Any] | None = None
) -> dict[str, Any]:
    """The assistant message of one generated turn: content and `tool_calls` in the chat-template form.

    Uses `tokenizer.parse_response` when the tokenizer defines a `response_template` (its message may
    also split off reasoning); otherwise the family's format (`detect_family`), Qwen's `<tool_call>`
    blocks by default. The content keeps the text around the calls, `<think>` blocks included.

    Args:
        tokenizer: The tokenizer whose chat template rendered the prompt.
        text: The decoded output of the turn, special tokens kept, end-of-sequence token removed.
        prefix: The rendered prompt (transformers' parser needs it when the template pre-writes part of
            the answer, e.g. an opening `<think>`).
        tools: The tools, for transformers' parser to cast arguments by their JSON schema.

    Raises:
        ToolCallParseError: A call does not parse; `.partial` is the message without it.
    """
    errors: list[str] = []
    if getattr(tokenizer, "response_template", None) is not None and hasattr(tokenizer, "parse_response"):
        try:
            message = dict(tokenizer.parse_response(text, prefix=prefix, tools=tools))
        except ValueError as exc:
            partial = {"role": "assistant", "content": text}
            raise ToolCallParseError(
                [f"the response parser of the tokenizer failed: {exc}"], partial
            ) from exc
        calls = []
        for call in message.pop("tool_calls", None) or []:
            function = call.get("function", call) if isinstance(call, dict) else None
            function = function if isinstance(function, dict) else {}
            try:
                raw = json.dumps(call, default=str)
                calls.append(_tool_call(function.get("name"), function.get("arguments", {}), raw))
            except ValueError as exc:
                errors.append(str(exc))
        message.update(role="assistant", content=message.get("content") or "")
    else:
        split = {LLAMA3: _split_llama, DEEPSEEK_V3: _split_deepseek}.get(
            detect_family(tokenizer), _split_qwen
        )
        content, calls, errors = split(text)
        message = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = calls
    if errors:
        raise ToolCallParseError(errors, message)
    return message


def parse_tool_calls(
    tokenizer: Any, text: str, *, prefix: str = "", tools: list[Any] | None = None
) -> list[dict]:
    """The tool calls of one generated turn, in order, each
    `{"type": "function", "function": {"name": str, "arguments": dict}}`; see `parse_assistant_message`.

    Raises:
        ToolCallParseError: A call does not parse (bad JSON, no name, arguments not an object).
    """
    return parse_assistant_message(tokenizer, text, prefix=prefix, tools=tools).get("tool_calls", [])
