"""The pieces of the default multi-turn tool loop: render, parse tool calls, run tools, environments.

One turn of `AsyncRolloutLoop.generate_one`:

    messages --render_prompt_ids--> prompt_ids --generate_one_turn--> output_ids
    output_ids --decode_output--> text --parse_assistant_message--> assistant message (+ tool_calls)
    tool_calls --execute_tool_call (in order; sync tools in the thread pool)--> tool messages

Tool calls are parsed in the model family's format by `asyncgrpo.data.tool_calls` (Qwen's
`<tool_call>` blocks, Llama 3.1 JSON, DeepSeek-V3 tokens, or the tokenizer's response parser). A
malformed call, an unknown name or a raising tool becomes a tool message that carries the error; it is
counted as a failed call, never raised.

Environments (`environment_factory`) get one instance per running rollout, taken from a pool so that an
expensive `__init__` is paid once; their public methods other than `reset` / `get_reward` are tools.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import json
import logging
import math
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from asyncgrpo import metrics as M
from asyncgrpo.data.prompts import ENVIRONMENT_COLUMN
from asyncgrpo.data.tool_calls import ToolCallParseError, parse_assistant_message
from asyncgrpo.rollout.reconcile import ReconciledRollout
from asyncgrpo.rollout.rewards import callable_name
from asyncgrpo.types import Rollout, TurnRecord

logger = logging.getLogger(__name__)

RESERVED_ENV_METHODS = frozenset({"reset", "get_reward"})


@runtime_checkable
class SupportsReset(Protocol):
    """What `environment_factory` makes: an object with `reset(**row)`, called before each rollout with the
    dataset row's columns; a returned string joins the prompt (`apply_reset_output`). Its other public
    methods are tools; `get_reward()`, when defined, scores the rollout."""

    def reset(self, **kwargs) -> str | None: ...


EnvironmentFactory = Callable[[], SupportsReset]


@dataclass(frozen=True)
class ToolResult:
    """What running one call produced: the tool message content and how it went."""

    name: str
    content: str
    failed: bool
    unknown_name: bool
    latency_s: float


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


async def call_maybe_async(fn: Callable, executor: Executor, *args: Any, **kwargs: Any) -> Any:
    """Await `fn(*args, **kwargs)` if it is a coroutine function, else run it in `executor`."""
    if inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(type(fn).__call__):
        return await fn(*args, **kwargs)
    loop = asyncio.get_running_loop()
    result = await loop.run_in_executor(executor, functools.partial(fn, *args, **kwargs))
    if inspect.isawaitable(result):  # a sync callable that returned a coroutine
        result = await result
    return result


async def execute_tool_call(
    name: str,
    arguments: dict[str, Any],
    tools_by_name: Mapping[str, Callable],
    executor: Executor,
    *,
    timeout_s: float | None = None,
) -> ToolResult:
    """Run one call `name(**arguments)`; every failure, a call running past `timeout_s` included,
    becomes a `ToolResult` with `failed=True`."""
    start = time.perf_counter()
    tool = tools_by_name.get(name)
    if tool is None:
        known = ", ".join(sorted(tools_by_name)) or "none"
        return ToolResult(name, f"Error: unknown tool {name!r}; available tools: {known}.", True, True, 0.0)
    try:
        result = await asyncio.wait_for(call_maybe_async(tool, executor, **arguments), timeout_s)
    except asyncio.TimeoutError:  # a sync tool's thread runs on; the rollout does not wait for it
        logger.warning("tool %s did not return within tool_call_timeout=%gs; reported to the model as an "
                       "error", name, timeout_s)
        return ToolResult(
            name, f"Error: the tool {name!r} timed out after {timeout_s:g} s.", True, False,
            time.perf_counter() - start,
        )
    except Exception as exc:  # noqa: BLE001 -- a raising tool is the policy's problem, reported to it
        logger.debug("tool %s raised %r", name, exc)
        return ToolResult(name, f"Error: {type(exc).__name__}: {exc}", True, False,
                          time.perf_counter() - start)
    content = result if isinstance(result, str) else json.dumps(result, default=str)
    return ToolResult(name, content, False, False, time.perf_counter() - start)


def parse_error_result(error: str) -> ToolResult:
    """The tool message for a call the model wrote that does not parse."""
    return ToolResult("<unparsed>", f"Error: {error}", True, False, 0.0)


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
        name = row.get(ENVIRONMENT_COLUMN)
        if name not in self._factories:
            raise ValueError(
                f"row environment={name!r} does not name an environment; environment_factory has "
                f"{sorted(k for k in self._factories if k is not None)}. Add an 'environment' column with "
                "one of them."
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


async def run_in_environment(
    pool: EnvironmentPool,
    row: Mapping[str, Any],
    prompt: list[dict[str, Any]],
    tools: Sequence[Callable],
    *,
    generate: Callable[[list[dict[str, Any]], list[Callable]], Awaitable[Any]],
    executor: Executor,
    record: Callable[[M.MetricRecord], None],
) -> tuple[Any, tuple[type, Any] | None, list[dict[str, Any]]]:
    """Run one rollout inside an environment instance taken from `pool`.

    `reset(**row)` (the row's columns, "prompt" included, as the reference passes them; "environment" is
    the trainer's and is not forwarded) may extend the prompt; the
    environment's public methods join `tools`; `get_reward()` (when defined) scores the rollout.

    Returns:
        `generate`'s rollout, `(environment class, reward)` or None, and the prompt that was used.
    """
    name = pool.select(row)
    env = pool.acquire(name)
    try:
        start = time.perf_counter()
        reset_kwargs = {k: v for k, v in row.items() if k != ENVIRONMENT_COLUMN}
        reset_output = await call_maybe_async(env.reset, executor, **reset_kwargs)
        record(M.metric(M.ENV_RESET_S, time.perf_counter() - start))
        env_prompt = apply_reset_output(prompt, reset_output)
        rollout = await generate(env_prompt, [*tools, *environment_tools(env)])
        env_reward = None
        if callable(getattr(env, "get_reward", None)):
            start = time.perf_counter()
            value = await call_maybe_async(env.get_reward, executor)
            record(M.metric(M.ENV_REWARD_S, time.perf_counter() - start))
            env_reward = (type(env), value)
        return rollout, env_reward, env_prompt
    finally:
        pool.release(name, env)


# -- the default generate_one ---------------------------------------------------------------------


async def run_tool_loop(
    prompt: list[dict[str, Any]],
    tools: list[Callable],
    *,
    generate_turn: Callable[[list[int]], Awaitable[TurnRecord]],
    tokenizer: Any,
    eos_token_ids: list[int],
    chat_template_kwargs: dict[str, Any],
    max_iterations: int | None,
    executor: Executor,
    record: Callable[[M.MetricRecord], None],
    tool_timeout_s: float | None = None,
) -> Rollout:
    """The multi-turn tool loop of `AsyncRolloutLoop.generate_one`.

    Each turn renders the whole conversation, samples with `generate_turn` and runs the tool calls
    of the answer in order (each bounded by `tool_timeout_s`); it stops at an answer without calls,
    or when `max_iterations` tool-calling turns ran and the model still calls tools
    (`tools/loop_exhausted_frac`). Without tools: one turn.
    """
    messages = [dict(m) for m in prompt]
    completion: list[dict[str, Any]] = []
    completion_ids: list[int] = []
    turns: list[TurnRecord] = []
    tools_by_name = {callable_name(t): t for t in tools}
    num_calls = num_failures = iterations = 0
    exhausted = False
    while True:
        turn = await generate_turn(render_prompt_ids(tokenizer, messages, tools, chat_template_kwargs))
        turns.append(turn)
        completion_ids.extend(turn.output_ids)
        text = decode_output(tokenizer, turn.output_ids, eos_token_ids)
        message, parse_errors = _assistant_message(tokenizer, text, turn.prompt_ids, tools)
        messages.append(message)
        completion.append(message)
        calls = message.get("tool_calls", [])
        if not calls and not parse_errors:
            break
        if max_iterations is not None and iterations >= max_iterations:
            exhausted = True
            break
        iterations += 1
        record(M.metric(M.TOOLS_PARALLEL_CALLS_MEAN, len(calls) + len(parse_errors)))
        results = [
            await execute_tool_call(
                call["function"]["name"], call["function"]["arguments"], tools_by_name, executor,
                timeout_s=tool_timeout_s,
            )
            for call in calls  # in the order the model wrote them
        ] + [parse_error_result(error) for error in parse_errors]
        for result in results:
            num_calls += 1
            num_failures += int(result.failed)
            for rec in tool_result_records(result):
                record(rec)
            messages.append(tool_message(result))
            completion.append(tool_message(result))
    if tools:
        record(M.metric(M.TOOLS_LOOP_EXHAUSTED_FRAC, float(exhausted)))
    return Rollout(
        completion=completion,
        completion_ids=completion_ids,
        turns=turns,
        tool_call_count=num_calls,
        tool_failure_count=num_failures,
    )


def _assistant_message(
    tokenizer: Any, text: str, prompt_ids: list[int], tools: list[Callable]
) -> tuple[dict[str, Any], list[str]]:
    """The assistant message of a turn and the errors of the calls that did not parse (no tools: text)."""
    if not tools:
        return {"role": "assistant", "content": text}, []
    prefix = (tokenizer.decode(prompt_ids, skip_special_tokens=False)
              if getattr(tokenizer, "response_template", None) else "")
    try:
        return parse_assistant_message(tokenizer, text, prefix=prefix, tools=tools), []
    except ToolCallParseError as exc:
        return exc.partial, exc.errors


def tool_result_records(result: ToolResult) -> list[M.MetricRecord]:
    """tools/* records of one executed call."""
    records = [
        M.metric(M.TOOLS_LATENCY_S, result.latency_s),
        M.metric(M.tool_latency_s(result.name), result.latency_s),
        M.metric(M.tool_call_count(result.name), 1),
        M.metric(M.tool_failure_count(result.name), int(result.failed)),
    ]
    if result.unknown_name:
        records.append(M.metric(M.TOOLS_UNKNOWN_NAME_COUNT, 1))
    return records


def generation_records(
    rollouts: Sequence[Rollout],
    reconciled: Sequence[ReconciledRollout],
    *,
    eos_token_ids: Sequence[int],
    has_tools: bool,
    seconds: float,
) -> list[M.MetricRecord]:
    """completions/*, rollout/* and tools/* records of one generated group (before scoring).

    Lengths count generated tokens only (tool results are not generated); a rollout is terminated
    when its last turn ends with an EOS token; a duplicate repeats an earlier rollout of the group
    token for token over all its turns. `seconds` is the span the generated-tokens rate covers.
    """
    eos = set(eos_token_ids)
    records: list[M.MetricRecord] = []
    seen: set[tuple[tuple[int, ...], ...]] = set()
    generated = 0
    for rollout, rec in zip(rollouts, reconciled, strict=True):
        length = sum(len(t.output_ids) for t in rollout.turns)
        generated += length
        last = rollout.turns[-1].output_ids if rollout.turns else []
        terminated = bool(last) and last[-1] in eos
        names = [M.COMPLETIONS_MEAN_LENGTH, M.COMPLETIONS_MIN_LENGTH, M.COMPLETIONS_MAX_LENGTH]
        if terminated:
            names += [
                M.COMPLETIONS_MEAN_TERMINATED_LENGTH,
                M.COMPLETIONS_MIN_TERMINATED_LENGTH,
                M.COMPLETIONS_MAX_TERMINATED_LENGTH,
            ]
        records += [M.metric(name, length) for name in names]
        records.append(M.metric(M.COMPLETIONS_CLIPPED_RATIO, float(not terminated)))
        key = tuple(tuple(t.output_ids) for t in rollout.turns)
        records.append(M.metric(M.COMPLETIONS_DUPLICATE_FRAC, float(key in seen)))
        seen.add(key)
        records += [M.metric(M.ROLLOUT_TURNS_MEAN, len(rollout.turns)),
                    M.metric(M.ROLLOUT_TURNS_MAX, len(rollout.turns))]
        records.append(M.metric(M.ROLLOUT_SAMPLES_PER_ROLLOUT, len(rec.sequences)))
        # over turn transitions (a fork always drifts); NaN in a window without any transition
        drift = rec.drift_tokens
        records += [
            M.ratio(M.ROLLOUT_FORK_FRAC, sum(d > 0 for d in drift), len(drift)),
            M.ratio(M.ROLLOUT_DRIFT_TOKENS_MEAN, sum(drift), len(drift)),
            M.metric(M.ROLLOUT_DRIFT_TOKENS_MAX, max(drift, default=math.nan)),
        ]
        if has_tools:  # the failure frequency is over calls: NaN in a window without any call
            records.append(M.metric(M.TOOLS_CALL_FREQUENCY, rollout.tool_call_count))
            records.append(M.ratio(M.TOOLS_FAILURE_FREQUENCY, rollout.tool_failure_count,
                                   rollout.tool_call_count))
    records.append(M.rate(M.ROLLOUT_GENERATED_TOKENS_PER_S, generated, seconds))
    return records
