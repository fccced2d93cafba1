"""Tool calls: the text of one generated turn -> the assistant message with its `tool_calls`, and the
OpenAI wire form of tools and calls <-> the chat-template form.

Parsing runs in the rollout process on every turn of a tool-using rollout (`asyncgrpo.rollout.generate`)
and in the embedded server, which answers `/v1/chat/completions` with the calls parsed back
(`asyncgrpo.server.chat`). The formats are the model families'
(`asyncgrpo.data.chat_templates.detect_family`): Qwen's `<tool_call>` blocks (the default), Llama 3's bare
JSON objects and DeepSeek-V3's special-token blocks, unless the tokenizer brings its own response parser.

The two forms of a call: chat templates take `{"type": "function", "function": {"name", "arguments":
dict}}`; the OpenAI API sends `{"id", "type": "function", "function": {"name", "arguments": JSON text}}`.
`calls_from_wire` / `calls_to_wire` convert, `check_tools` validates an OpenAI `tools` list. Pure: text
and dicts in, dicts out.
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

__all__ = [
    "ToolCallParseError",
    "calls_from_wire",
    "calls_to_wire",
    "check_tools",
    "parse_assistant_message",
    "parse_tool_calls",
]


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
    ends = [m.start() for m in matches[1:]] + [len(text)]
    between = (text[a.end() : end] for a, end in zip(matches, ends, strict=True))
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


# -- the OpenAI wire form ------------------------------------------------------------------------------


def check_tools(tools: Any) -> list[dict[str, Any]]:
    """An OpenAI `tools` list, checked: each `{"type": "function", "function": {"name": str, "description"?:
    str, "parameters"?: object}}` (what chat templates render).

    Raises:
        ValueError: Naming the first malformed tool and the expected shape.
    """
    if not isinstance(tools, list):
        raise ValueError(f'tools must be a list of {{"type": "function", "function": {{...}}}}, '
                         f"got {tools!r:.80}")
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(function, dict) or tool.get("type", "function") != "function":
            raise ValueError(f'tools[{i}] must be {{"type": "function", "function": {{"name": ...}}}}, '
                             f"got {tool!r:.80}")
        if not isinstance(function.get("name"), str) or not function["name"]:
            raise ValueError(f"tools[{i}].function.name must be a non-empty string, "
                             f"got {function.get('name')!r:.80}")
        if not isinstance(function.get("parameters", {}), (dict, type(None))):
            raise ValueError(f"tools[{i}].function.parameters must be a JSON schema object")
    return tools


def calls_from_wire(calls: Any) -> list[dict[str, Any]]:
    """The `tool_calls` of an assistant message as a client sends them (arguments as JSON text, or an
    object) -> the chat-template form (arguments an object); each call's `id` is kept.

    Raises:
        ValueError: A call that is not `{"type": "function", "function": {"name", "arguments"}}`, or
            arguments that are not a JSON object.
    """
    if not isinstance(calls, list):
        raise ValueError(f"tool_calls must be a list, got {calls!r:.80}")
    out = []
    for i, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise ValueError(f'tool_calls[{i}] must be {{"type": "function", "function": {{"name", '
                             f'"arguments"}}}}, got {call!r:.80}')
        arguments = function.get("arguments", {})
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except json.JSONDecodeError as exc:
                raise ValueError(f"tool_calls[{i}].function.arguments is not JSON ({exc.msg}): "
                                 f"{arguments!r:.80}") from exc
        if not isinstance(arguments, dict):
            raise ValueError(f"tool_calls[{i}].function.arguments must be a JSON object, "
                             f"got {arguments!r:.80}")
        converted = {"type": "function", "function": {"name": function["name"], "arguments": arguments}}
        if "id" in call:
            converted["id"] = call["id"]
        out.append(converted)
    return out


def calls_to_wire(calls: list[dict[str, Any]], ids: list[str]) -> list[dict[str, Any]]:
    """Parsed calls (the chat-template form) -> an OpenAI `message.tool_calls`: `{"id", "type": "function",
    "function": {"name", "arguments": JSON text}}`, with `ids[i]` the id of call i."""
    assert len(ids) == len(calls), "one id per call"
    return [
        {"id": call_id, "type": "function",
         "function": {"name": call["function"]["name"],
                      "arguments": json.dumps(call["function"]["arguments"], ensure_ascii=False)}}
        for call, call_id in zip(calls, ids, strict=True)
    ]
