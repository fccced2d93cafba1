"""The pieces of the default multi-turn tool loop: render, parse tool calls, run tools, environments.

One turn of `AsyncRolloutLoop.generate_one`:

    messages --render_prompt_ids--> prompt_ids --generate_one_turn--> output_ids
    output_ids --decode_output--> text --parse_tool_calls--> (content, calls)
    calls --execute_tool_call (in order; sync tools in the thread pool)--> tool messages

The model calls a tool by writing `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (the
Qwen / Hermes convention that the bundled chat template uses). A malformed block, an unknown name or a
raising tool becomes a tool message that carries the error; it is counted, never raised.

Environments (`environment_factory`) get one instance per running rollout, taken from a pool so that an
expensive `__init__` is paid once; their public methods other than `reset` / `get_reward` are tools.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import json
import logging
import re
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)

TOOL_CALL_RE = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
RESERVED_ENV_METHODS = frozenset({"reset", "get_reward"})


@dataclass(frozen=True)
class ToolCall:
    """One parsed `<tool_call>` block. `error` is set (and name may be "") when it did not parse."""

    name: str
    arguments: dict[str, Any]
    error: str | None = None


@dataclass(frozen=True)
class ToolResult:
    """What running one call produced: the tool message content and how it went."""

    name: str
    content: str
    failed: bool
    unknown_name: bool
    latency_s: float


def tool_name(tool: Callable) -> str:
    """The name the model calls a tool by: its `__name__` (a partial's function name)."""
    while isinstance(tool, functools.partial):
        tool = tool.func
    return getattr(tool, "__name__", type(tool).__name__)


def render_prompt_ids(
    tokenizer: Any, messages: list[dict[str, Any]], tools: list[Callable] | None, chat_template_kwargs: dict
) -> list[int]:
    """Token ids of the whole conversation rendered with the chat template and a generation prompt."""
    encoded = tokenizer.apply_chat_template(
        messages, tools=tools or None, add_generation_prompt=True, tokenize=True, **chat_template_kwargs
    )
    if isinstance(encoded, Mapping) or hasattr(encoded, "input_ids"):
        encoded = encoded["input_ids"]
    return [int(t) for t in encoded]


def decode_output(tokenizer: Any, output_ids: list[int], eos_token_ids: list[int]) -> str:
    """The generated text of one turn, without its final end-of-sequence token(s)."""
    ids = list(output_ids)
    eos = set(eos_token_ids)
    while ids and ids[-1] in eos:
        ids.pop()
    return tokenizer.decode(ids, skip_special_tokens=False)


def parse_tool_calls(text: str) -> tuple[str, list[ToolCall]]:
    """Split a turn's text into its content (tool-call blocks removed) and the calls, in order.

    A block must hold a JSON object with a string "name" and an object "arguments" (a JSON string
    holding an object is accepted too); anything else gives a `ToolCall` with `error` set.
    """
    calls: list[ToolCall] = []
    for match in TOOL_CALL_RE.finditer(text):
        raw = match.group(1).strip()
        try:
            payload = json.loads(raw)
        except json.JSONDecodeError as exc:
            calls.append(ToolCall("", {}, f"could not parse the tool call as JSON ({exc.msg}): {raw[:200]}"))
            continue
        name = payload.get("name") if isinstance(payload, dict) else None
        arguments = payload.get("arguments", {}) if isinstance(payload, dict) else None
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                arguments = None
        if not isinstance(name, str) or not isinstance(arguments, dict):
            calls.append(
                ToolCall(
                    name if isinstance(name, str) else "",
                    {},
                    'a tool call must be {"name": <string>, "arguments": <object>}, got: ' + raw[:200],
                )
            )
            continue
        calls.append(ToolCall(name, arguments))
    content = TOOL_CALL_RE.sub("", text).strip() if calls else text
    return content, calls


def assistant_message(content: str, calls: list[ToolCall]) -> dict[str, Any]:
    """The assistant message of a turn, in the chat-template format (`tool_calls` when it has calls)."""
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = [
            {"type": "function", "function": {"name": call.name, "arguments": call.arguments}} for call in calls
        ]
    return message


async def call_maybe_async(fn: Callable, executor: Executor, *args: Any, **kwargs: Any) -> Any:
    """Await `fn(*args, **kwargs)` if it is a coroutine function, else run it in `executor`."""
    if inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None)):
        return await fn(*args, **kwargs)
    loop = asyncio.get_running_loop()
    result = await loop.run_in_executor(executor, functools.partial(fn, *args, **kwargs))
    if inspect.isawaitable(result):  # a sync callable that returned a coroutine
        result = await result
    return result


async def execute_tool_call(call: ToolCall, tools_by_name: Mapping[str, Callable], executor: Executor) -> ToolResult:
    """Run one parsed call; every failure becomes a `ToolResult` with `failed=True`."""
    start = time.perf_counter()
    if call.error is not None:
        return ToolResult(call.name or "<unparsed>", f"Error: {call.error}", True, False, 0.0)
    tool = tools_by_name.get(call.name)
    if tool is None:
        known = ", ".join(sorted(tools_by_name)) or "none"
        content = f"Error: unknown tool {call.name!r}; available tools: {known}."
        return ToolResult(call.name, content, True, True, 0.0)
    try:
        result = await call_maybe_async(tool, executor, **call.arguments)
    except Exception as exc:  # noqa: BLE001 -- a raising tool is the policy's problem, reported to it
        logger.debug("tool %s raised %r", call.name, exc)
        return ToolResult(call.name, f"Error: {type(exc).__name__}: {exc}", True, False, time.perf_counter() - start)
    content = result if isinstance(result, str) else json.dumps(result, default=str)
    return ToolResult(call.name, content, False, False, time.perf_counter() - start)


def tool_message(result: ToolResult) -> dict[str, Any]:
    return {"role": "tool", "name": result.name, "content": result.content}


# -- environments ---------------------------------------------------------------------------------


def environment_tools(env: Any) -> list[Callable]:
    """The public methods of an environment instance that the model may call (not reset/get_reward)."""
    tools = []
    for name in dir(type(env)):
        if name.startswith("_") or name in RESERVED_ENV_METHODS:
            continue
        attr = getattr(env, name, None)
        if callable(attr) and inspect.ismethod(attr):
            tools.append(attr)
    return tools


class EnvironmentPool:
    """Reusable environment instances per factory name; one instance is held per running rollout.

    `factories` is `{None: factory}` for a single `environment_factory`, else the user's dict.
    """

    def __init__(self, factories: Mapping[str | None, Callable[[], Any]]) -> None:
        self._factories = dict(factories)
        self._idle: dict[str | None, list[Any]] = {name: [] for name in self._factories}

    @classmethod
    def from_argument(cls, environment_factory: Any) -> EnvironmentPool | None:
        if environment_factory is None:
            return None
        if isinstance(environment_factory, Mapping):
            return cls(dict(environment_factory))
        return cls({None: environment_factory})

    def select(self, row: Mapping[str, Any]) -> str | None:
        """The factory name for a dataset row (its "environment" field when there are several)."""
        if None in self._factories:
            return None
        name = row.get("environment")
        if name not in self._factories:
            raise ValueError(
                f"row environment={name!r} does not name an environment; environment_factory has "
                f"{sorted(k for k in self._factories if k is not None)}. Add an 'environment' column with one of them."
            )
        return name

    def acquire(self, name: str | None) -> Any:
        idle = self._idle[name]
        return idle.pop() if idle else self._factories[name]()

    def release(self, name: str | None, env: Any) -> None:
        self._idle[name].append(env)


def apply_reset_output(prompt: list[dict[str, Any]], output: Any) -> list[dict[str, Any]]:
    """The prompt after `reset()`: a returned string is appended to the last user message, or becomes
    the user message when the prompt is empty; `None` leaves the prompt unchanged."""
    if output is None:
        return list(prompt)
    if not isinstance(output, str):
        raise TypeError(f"environment reset() must return None or a str, got {type(output).__name__}")
    messages = [dict(m) for m in prompt]
    for message in reversed(messages):
        if message.get("role") == "user":
            existing = message.get("content") or ""
            message["content"] = f"{existing}\n\n{output}" if existing else output
            return messages
    messages.append({"role": "user", "content": output})
    return messages
