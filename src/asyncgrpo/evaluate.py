"""Held-out success rate of the policy being served: sampled rollouts scored like training ones.

The same turn / tool loop as training (`asyncgrpo.rollout.generate`), through the same client, so a
number measured here is the one RL optimises: single-turn tasks (a score function on the completion)
and tool or environment tasks (the environment's `get_reward`).

    rate = evaluate(url, tokenizer, rows, score=..., samples=4)               # synchronous wrapper
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from asyncgrpo.generation.client import GenerationClient
from asyncgrpo.generation.protocol import SamplingParams
from asyncgrpo.rollout.generate import EnvironmentPool, run_in_environment, run_tool_loop
from asyncgrpo.rollout.requests import request_seed
from asyncgrpo.types import Rollout, TurnRecord

ScoreFn = Callable[[dict, Rollout], float]


def evaluate(url: str, tokenizer: Any, rows: Sequence[dict], **kwargs: Any) -> float:
    """`evaluate_async` run to completion (for scripts and callbacks)."""
    return asyncio.run(evaluate_async(url, tokenizer, rows, **kwargs))


async def evaluate_async(
    url: str,
    tokenizer: Any,
    rows: Sequence[dict],
    *,
    score: ScoreFn | None = None,
    environment_factory: Callable[[], Any] | None = None,
    tools: Sequence[Callable] = (),
    samples: int = 4,
    temperature: float = 1.0,
    max_tokens: int = 64,
    max_tool_calling_iterations: int | None = 8,
    chat_template_kwargs: dict | None = None,
    eos_token_ids: Sequence[int] | None = None,
    seed: int = 0,
    max_concurrency: int = 64,
    api_key: str | None = None,
) -> float:
    """Mean score over `samples` rollouts of every row.

    Args:
        url: the generation server (vLLM or embedded) serving the policy.
        tokenizer: renders the conversation with its chat template.
        rows: dataset rows with a conversational `prompt` (and whatever `score`/`reset` reads).
        score: `score(row, rollout) -> float` for tasks scored on the completion; with an
            environment that defines `get_reward`, that is the score instead.
        environment_factory: one environment per rollout (`reset(**row)`, tools, `get_reward`).
        samples: rollouts per row, each with its own seed.
        api_key: the server's `--api-key` (the trainer's `vllm_server_api_key`), if it has one.
    """
    if score is None and environment_factory is None:
        raise ValueError("evaluate needs `score` or an `environment_factory` with get_reward()")
    eos = list(eos_token_ids) if eos_token_ids is not None else [tokenizer.eos_token_id]
    client = GenerationClient(url, timeout_s=600, api_key=api_key)
    pool = EnvironmentPool.from_argument(environment_factory)
    executor = ThreadPoolExecutor(max_workers=max_concurrency)
    limit = asyncio.Semaphore(max_concurrency)
    await client.start()
    try:
        await client.detect()

        async def one(i: int, j: int) -> float:
            row = rows[i]
            turn_index = 0

            async def generate_turn(prompt_ids: list[int]) -> TurnRecord:
                nonlocal turn_index
                params = SamplingParams(
                    temperature=temperature, max_tokens=max_tokens, stop_token_ids=tuple(eos),
                    seed=request_seed(seed, i, j, turn_index),
                )
                turn_index += 1
                out = await client.generate(prompt_ids, params)
                return TurnRecord(prompt_ids=list(prompt_ids), output_ids=list(out.token_ids),
                                  output_log_probs=list(out.logprobs or []))

            async def generate(prompt: list[dict], turn_tools: list[Callable]) -> Rollout:
                return await run_tool_loop(
                    prompt, turn_tools, generate_turn=generate_turn, tokenizer=tokenizer, eos_token_ids=eos,
                    chat_template_kwargs=dict(chat_template_kwargs or {}),
                    max_iterations=max_tool_calling_iterations, executor=executor, record=lambda _: None,
                )

            async with limit:
                prompt = list(row.get("prompt") or [])
                if pool is None:
                    rollout = await generate(prompt, list(tools))
                    return float(score(row, rollout))
                rollout, env_reward, _ = await run_in_environment(
                    pool, row, prompt, list(tools), generate=generate, executor=executor,
                    record=lambda _: None,
                )
                if env_reward is not None:
                    return float(env_reward[1])
                return float(score(row, rollout))

        results = await asyncio.gather(*(one(i, j) for i in range(len(rows)) for j in range(samples)))
    finally:
        await client.close()
        executor.shutdown(wait=False)
    return sum(results) / max(len(results), 1)


def last_message_text(rollout: Rollout) -> str:
    """The content of the rollout's final assistant message."""
    for message in reversed(rollout.completion):
        if message.get("role") == "assistant":
            return message.get("content") or ""
    return ""
