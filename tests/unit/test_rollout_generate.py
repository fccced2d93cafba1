"""The tool-loop helpers: tool-call parsing, tool execution, environment pool, reset output."""

from __future__ import annotations

import asyncio
import functools
from concurrent.futures import ThreadPoolExecutor

import pytest

from asyncgrpo.rollout.generate import (
    EnvironmentPool,
    ToolCall,
    apply_reset_output,
    assistant_message,
    environment_tools,
    execute_tool_call,
    parse_tool_calls,
    tool_name,
)


def multiply(a: int, b: int) -> int:
    """Multiplies two integers.

    Args:
        a: The first integer.
        b: The second integer.
    """
    return a * b


async def async_add(a: int, b: int) -> int:
    """Adds two integers.

    Args:
        a: The first integer.
        b: The second integer.
    """
    await asyncio.sleep(0)
    return a + b


def broken(x: int) -> int:
    """Always raises.

    Args:
        x: Ignored.
    """
    raise RuntimeError("tool exploded")


class Counter:
    def __init__(self) -> None:
        self.value = 0

    def reset(self, **kwargs):
        self.value = 0

    def get_reward(self) -> float:
        return float(self.value)

    def increment(self, step: int) -> int:
        """Increment.

        Args:
            step: How much.
        """
        self.value += step
        return self.value

    def _private(self) -> None:
        pass


def test_parse_tool_calls_in_order_and_strips_blocks():
    text = (
        'Let me compute.<tool_call>\n{"name": "multiply", "arguments": {"a": 3, "b": 4}}\n</tool_call>'
        '<tool_call>{"name": "async_add", "arguments": "{\\"a\\": 1, \\"b\\": 2}"}</tool_call>'
    )
    content, calls = parse_tool_calls(text)
    assert content == "Let me compute."
    assert calls == [ToolCall("multiply", {"a": 3, "b": 4}), ToolCall("async_add", {"a": 1, "b": 2})]


def test_parse_tool_calls_without_calls_keeps_text():
    assert parse_tool_calls("The answer is \\boxed{4}.") == ("The answer is \\boxed{4}.", [])


def test_malformed_tool_call_is_a_call_with_an_error():
    _, calls = parse_tool_calls("<tool_call>{not json}</tool_call><tool_call>[1, 2]</tool_call>")
    assert len(calls) == 2
    assert all(call.error for call in calls)
    assert "JSON" in calls[0].error


def test_assistant_message_carries_tool_calls():
    message = assistant_message("hi", [ToolCall("multiply", {"a": 1, "b": 2})])
    assert message["tool_calls"] == [{"type": "function", "function": {"name": "multiply", "arguments": {"a": 1, "b": 2}}}]
    assert "tool_calls" not in assistant_message("hi", [])


def test_execute_tool_calls_sync_async_unknown_raising():
    tools = {tool_name(t): t for t in (multiply, async_add, broken)}

    async def run():
        with ThreadPoolExecutor(2) as pool:
            return [
                await execute_tool_call(ToolCall("multiply", {"a": 6, "b": 7}), tools, pool),
                await execute_tool_call(ToolCall("async_add", {"a": 1, "b": 2}), tools, pool),
                await execute_tool_call(ToolCall("nope", {}), tools, pool),
                await execute_tool_call(ToolCall("broken", {"x": 1}), tools, pool),
                await execute_tool_call(ToolCall("multiply", {"c": 1}), tools, pool),
                await execute_tool_call(ToolCall("", {}, error="bad json"), tools, pool),
            ]

    ok, added, unknown, raised, bad_args, unparsed = asyncio.run(run())
    assert (ok.content, ok.failed) == ("42", False)
    assert (added.content, added.failed) == ("3", False)
    assert unknown.failed and unknown.unknown_name and "nope" in unknown.content and "multiply" in unknown.content
    assert raised.failed and not raised.unknown_name and "tool exploded" in raised.content
    assert bad_args.failed and "TypeError" in bad_args.content
    assert unparsed.failed and "bad json" in unparsed.content


def test_tool_name_of_partial_is_its_function():
    assert tool_name(functools.partial(multiply, b=2)) == "multiply"


def test_environment_tools_are_public_non_reserved_methods():
    env = Counter()
    names = sorted(t.__name__ for t in environment_tools(env))
    assert names == ["increment"]
    environment_tools(env)[0](step=3)
    assert env.get_reward() == 3.0


def test_environment_pool_reuses_instances_and_routes_by_row():
    pool = EnvironmentPool.from_argument({"a": Counter, "b": Counter})
    assert pool.select({"environment": "b"}) == "b"
    with pytest.raises(ValueError, match="environment"):
        pool.select({"environment": "zzz"})
    env = pool.acquire("a")
    pool.release("a", env)
    assert pool.acquire("a") is env
    assert pool.acquire("a") is not env
    single = EnvironmentPool.from_argument(Counter)
    assert single.select({}) is None
    assert EnvironmentPool.from_argument(None) is None


def test_reset_output_appended_to_last_user_message_or_becomes_prompt():
    prompt = [{"role": "system", "content": "s"}, {"role": "user", "content": "Do it."}]
    assert apply_reset_output(prompt, None) == prompt
    assert apply_reset_output(prompt, "Target 3.")[-1]["content"] == "Do it.\n\nTarget 3."
    assert prompt[-1]["content"] == "Do it."  # not mutated
    assert apply_reset_output([], "Go.") == [{"role": "user", "content": "Go."}]
    with pytest.raises(TypeError):
        apply_reset_output(prompt, 3)
