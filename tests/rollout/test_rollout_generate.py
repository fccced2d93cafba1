"""The rollout generation helpers: tool calls, the tool loop, environments, seeds, generation metrics."""

from __future__ import annotations

import asyncio
import functools
import math
from concurrent.futures import ThreadPoolExecutor

import pytest

from asyncgrpo.metrics import MetricsWindow
from asyncgrpo.rollout.generate import (
    EnvironmentPool,
    apply_reset_output,
    environment_tools,
    execute_tool_call,
    generation_records,
    run_in_environment,
    run_tool_loop,
)
from asyncgrpo.rollout.reconcile import reconcile_turns
from asyncgrpo.rollout.requests import RequestSettings, request_seed
from asyncgrpo.rollout.rewards import callable_name
from asyncgrpo.types import Rollout, TurnRecord


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


def test_execute_tool_calls_sync_async_unknown_raising():
    tools = {callable_name(t): t for t in (multiply, async_add, broken)}

    async def run():
        with ThreadPoolExecutor(2) as pool:
            return [
                await execute_tool_call("multiply", {"a": 6, "b": 7}, tools, pool),
                await execute_tool_call("async_add", {"a": 1, "b": 2}, tools, pool),
                await execute_tool_call("nope", {}, tools, pool),
                await execute_tool_call("broken", {"x": 1}, tools, pool),
                await execute_tool_call("multiply", {"c": 1}, tools, pool),
            ]

    ok, added, unknown, raised, bad_args = asyncio.run(run())
    assert (ok.content, ok.failed) == ("42", False)
    assert (added.content, added.failed) == ("3", False)
    assert (unknown.failed and unknown.unknown_name and "nope" in unknown.content
            and "multiply" in unknown.content)
    assert raised.failed and not raised.unknown_name and "tool exploded" in raised.content
    assert bad_args.failed and "TypeError" in bad_args.content


def test_tool_name_of_partial_is_its_function():
    assert callable_name(functools.partial(multiply, b=2)) == "multiply"


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


RESETS: list[dict] = []


class _ResetRecorder:
    def reset(self, **kwargs):
        RESETS.append(kwargs)


def test_reset_gets_every_column_of_the_row_but_the_environments_name():
    """As the reference: `reset(**row)`, the prompt included; the `environment` column is the trainer's."""
    pool = EnvironmentPool.from_argument({"rec": _ResetRecorder})
    prompt = [{"role": "user", "content": "Count."}]
    row = {"prompt": prompt, "target": 3, "environment": "rec"}

    async def generate(env_prompt, tools):
        return env_prompt

    with ThreadPoolExecutor(1) as executor:
        asyncio.run(run_in_environment(pool, row, prompt, [], generate=generate, executor=executor,
                                       record=lambda record: None))
    assert RESETS == [{"prompt": prompt, "target": 3}]


def test_reset_output_appended_to_last_user_message_or_becomes_prompt():
    prompt = [{"role": "system", "content": "s"}, {"role": "user", "content": "Do it."}]
    assert apply_reset_output(prompt, None) == prompt
    assert apply_reset_output(prompt, "Target 3.")[-1]["content"] == "Do it.\n\nTarget 3."
    assert prompt[-1]["content"] == "Do it."  # not mutated
    assert apply_reset_output([], "Go.") == [{"role": "user", "content": "Go."}]
    with pytest.raises(TypeError):
        apply_reset_output(prompt, 3)


# -- seeds, sampling settings, the tool loop, generation metrics ----------------------------------


def test_request_seeds_are_unique_per_rollout_and_turn_and_deterministic():
    seeds = {request_seed(42, p, r, t) for p in range(20) for r in range(8) for t in range(3)}
    assert len(seeds) == 20 * 8 * 3
    assert all(0 <= s < 2**63 for s in seeds)
    assert request_seed(42, 1, 2, 3) == request_seed(42, 1, 2, 3) != request_seed(43, 1, 2, 3)


def test_sampling_params_follow_the_config():
    from asyncgrpo.config import AsyncGRPOConfig

    config = AsyncGRPOConfig(output_dir="/tmp/asyncgrpo-test-generate", temperature=0.7, top_k=50, top_p=0.9,
                             max_completion_length=17, num_sampler_logprobs=5, report_to="none")
    params = RequestSettings.from_config(config, [3, 4]).params(seed=11, return_sampling_mask=True)
    assert (params.temperature, params.top_k, params.top_p, params.max_tokens) == (0.7, 50, 0.9, 17)
    assert params.seed == 11 and params.stop_token_ids == (3, 4) and params.return_sampling_mask
    assert params.logprobs == 5  # score_centering (the default) asks for the sampler's top-K
    config.score_centering = False
    assert RequestSettings.from_config(config, [3]).params(seed=0, return_sampling_mask=False).logprobs == 0


class _CharTokenizer:
    """Renders a conversation as text and maps characters to ids (ord), enough for the tool loop."""

    def apply_chat_template(self, messages, tools=None, add_generation_prompt=True, tokenize=True, **kwargs):
        text = "".join(f"<{m['role']}>{m.get('content', '')}" for m in messages) + "<assistant>"
        return [ord(c) for c in text]

    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(i) for i in ids)


def test_tool_loop_runs_calls_until_an_answer_without_calls():
    answers = iter([
        '<tool_call>{"name": "multiply", "arguments": {"a": 6, "b": 7}}</tool_call>',
        '<tool_call>{"name": "nope", "arguments": {}}</tool_call><tool_call>{not json}</tool_call>',
        "It is 42.",
    ])
    prompts: list[list[int]] = []

    async def generate_turn(prompt_ids):
        prompts.append(prompt_ids)
        out = [ord(c) for c in next(answers)] + [0]
        return TurnRecord(prompt_ids=prompt_ids, output_ids=out, output_log_probs=[-1.0] * len(out))

    records = []

    async def run():
        with ThreadPoolExecutor(2) as pool:
            return await run_tool_loop(
                [{"role": "user", "content": "6*7?"}], [multiply], generate_turn=generate_turn,
                tokenizer=_CharTokenizer(), eos_token_ids=[0], chat_template_kwargs={}, max_iterations=None,
                executor=pool, record=records.append,
            )

    rollout = asyncio.run(run())
    assert len(rollout.turns) == 3
    assert (rollout.tool_call_count, rollout.tool_failure_count) == (3, 2)
    roles = ["assistant", "tool", "assistant", "tool", "tool", "assistant"]
    assert [m["role"] for m in rollout.completion] == roles
    assert rollout.completion[0]["tool_calls"] == [
        {"type": "function", "function": {"name": "multiply", "arguments": {"a": 6, "b": 7}}}
    ]
    assert rollout.completion[1]["content"] == "42"
    assert "unknown tool 'nope'" in rollout.completion[3]["content"]
    assert "JSON" in rollout.completion[4]["content"]  # a malformed call is answered, not raised
    assert rollout.completion[-1] == {"role": "assistant", "content": "It is 42."}
    # each turn re-renders the whole conversation: the tool result is in the next prompt
    assert "<tool>42" in "".join(chr(i) for i in prompts[1])
    assert rollout.completion_ids == [t for turn in rollout.turns for t in turn.output_ids]
    names = [r[0] for r in records]
    assert names.count("tools/unknown_name_count") == 1 and "tools/multiply/latency_s" in names
    assert ("tools/loop_exhausted_frac", 0.0) in [(r[0], r[1]) for r in records]


def test_tool_loop_stops_at_max_iterations():
    async def generate_turn(prompt_ids):
        out = [ord(c) for c in '<tool_call>{"name": "multiply", "arguments": {"a": 1, "b": 1}}</tool_call>']
        return TurnRecord(prompt_ids=prompt_ids, output_ids=out, output_log_probs=[-1.0] * len(out))

    records = []

    async def run():
        with ThreadPoolExecutor(1) as pool:
            return await run_tool_loop(
                [{"role": "user", "content": "go"}], [multiply], generate_turn=generate_turn,
                tokenizer=_CharTokenizer(), eos_token_ids=[0], chat_template_kwargs={}, max_iterations=2,
                executor=pool, record=records.append,
            )

    rollout = asyncio.run(run())
    assert len(rollout.turns) == 3 and rollout.tool_call_count == 2  # the third turn's call is not run
    assert ("tools/loop_exhausted_frac", 1.0) in [(r[0], r[1]) for r in records]


def _rollout(*outputs: list[int]) -> Rollout:
    turns = [TurnRecord(prompt_ids=[1], output_ids=list(o), output_log_probs=[0.0] * len(o)) for o in outputs]
    return Rollout(completion=[], completion_ids=[t for o in outputs for t in o], turns=turns)


def test_generation_records_against_a_hand_count():
    eos = 0
    rollouts = [_rollout([5, 6, eos]), _rollout([5, 6, eos]), _rollout([7, 8, 9, 9]), _rollout([5], [6, eos])]
    reconciled = [reconcile_turns(r.turns) for r in rollouts]
    records = generation_records(rollouts, reconciled, eos_token_ids=[eos], has_tools=False, seconds=2.0)
    by_name: dict[str, list] = {}
    for rec in records:
        by_name.setdefault(rec.name, []).append(rec)
    values = {name: [r.value for r in recs] for name, recs in by_name.items()}
    assert values["completions/mean_length"] == [3, 3, 4, 3]
    assert values["completions/mean_terminated_length"] == [3, 3, 3]  # the third was clipped
    assert values["completions/clipped_ratio"] == [0.0, 0.0, 1.0, 0.0]
    assert values["completions/duplicate_frac"] == [0.0, 1.0, 0.0, 0.0]
    assert values["rollout/turns_max"] == [1, 1, 1, 2]
    assert values["rollout/samples_per_rollout"] == [1, 1, 1, 2]  # prompt [1] does not extend [1, 5]
    assert values["rollout/drift_tokens_max"][-1] == 1  # NaN for the one-turn rollouts
    (rate,) = by_name["rollout/generated_tokens_per_s"]
    assert (rate.value, rate.denominator) == (13, 2.0)
    assert "tools/call_frequency" not in values
    # over the turn transitions: the one two-turn rollout forked once
    window = MetricsWindow()
    for rec in records:
        window.add(rec)
    logged = window.reduce()
    assert logged["rollout/fork_frac"] == 1.0 and logged["rollout/drift_tokens_mean"] == 1.0


def test_metrics_undefined_in_a_window_are_logged_as_nan():
    # no turn transition: fork_frac and drift are undefined; with tools but no call, so is the failure
    # frequency (where GRPO would log 0.0)
    rollouts = [_rollout([5, 6, 0]), _rollout([7, 0])]
    records = generation_records(rollouts, [reconcile_turns(r.turns) for r in rollouts], eos_token_ids=[0],
                                 has_tools=True, seconds=1.0)
    window = MetricsWindow()
    for rec in records:
        window.add(rec)
    logged = window.reduce()
    for name in ("rollout/fork_frac", "rollout/drift_tokens_mean", "rollout/drift_tokens_max",
                 "tools/failure_frequency"):
        assert math.isnan(logged[name]), name
    assert logged["tools/call_frequency"] == 0.0
