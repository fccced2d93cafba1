"""Training with a plain tool: a module-level function the model calls, scored from the completion.

`tools=[fn, ...]` takes plain functions with type hints and a Google-style docstring (their JSON
schema is built from them); sync ones run in a thread pool, async ones are awaited in the rollout.
A malformed call, an unknown tool name or a raising tool becomes a tool message carrying the error
(counted under tools/*), never a crash. Reward functions see the whole conversation: here they read
the tool messages.

The task is the counter of the bundled tiny model, without an environment class: `increment` is an
async function, and the counter it raises belongs to the rollout that calls it. Every rollout runs as
its own asyncio task and an async tool runs inside it, so a `contextvars.ContextVar` set there is
that rollout's alone. (Anything richer than one value, or a tool that must run in threads, wants
`environment_factory`: one object per rollout, see increment_env.py.) The tiny model only knows
this tool's exact signature and docstring; other tools confuse it.

    python examples/tools.py --max-steps 30
"""

from __future__ import annotations

import argparse
import contextvars
import os

from datasets import Dataset

from asyncgrpo import AsyncGRPOConfig, AsyncGRPOTrainer
from asyncgrpo.cli import at_least
from asyncgrpo.launch import EmbeddedServer
from asyncgrpo.tasks import counter

MODEL = "asyncgrpo/tiny-chat"

_counter: contextvars.ContextVar[int] = contextvars.ContextVar("counter", default=0)


async def increment(step: int) -> int:
    """
    Increment the internal counter.

    Args:
        step: Value to add to the counter.

    Returns:
        The updated counter value.
    """
    if step < 1:
        raise ValueError(f"step must be at least 1, got {step}")
    _counter.set(_counter.get() + step)
    return _counter.get()


def failed_call(message: dict) -> bool:
    """A tool message that reports a failed call: the tool loop answers those with "Error: ..."."""
    return message["role"] == "tool" and str(message.get("content", "")).startswith("Error:")


def reached_target(
    completions: list[list[dict]], target: list[int], max_step: list[int], **kwargs
) -> list[float]:
    """1.0 when the last counter value the tool returned is the target and no step exceeded max_step."""
    rewards = []
    for messages, goal, limit in zip(completions, target, max_step):
        steps = [call["function"]["arguments"].get("step")
                 for m in messages for call in m.get("tool_calls", [])]
        values = [m["content"] for m in messages if m["role"] == "tool" and not failed_call(m)]
        within = all(isinstance(s, int) and s <= limit for s in steps)
        rewards.append(float(within and bool(values) and values[-1] == str(goal)))
    return rewards


def tool_error_penalty(completions: list[list[dict]], **kwargs) -> list[float]:
    """-0.1 per failed tool call."""
    return [-0.1 * sum(failed_call(m) for m in completion) for completion in completions]


def main(argv: list[str] | None = None) -> list[dict]:
    """Train; returns the Trainer's log history."""
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-steps", type=at_least(1), default=30)
    parser.add_argument("--model", default=MODEL)
    parser.add_argument("--output-dir", default="asyncgrpo-tools")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.model == MODEL:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
    with EmbeddedServer(args.model) as server:
        trainer = AsyncGRPOTrainer(
            model=args.model,
            reward_funcs=[reached_target, tool_error_penalty],
            train_dataset=Dataset.from_list(counter.make_dataset(2000, seed=args.seed)),
            tools=[increment],
            args=AsyncGRPOConfig(
                output_dir=args.output_dir, vllm_server_base_url=server.url, max_steps=args.max_steps,
                learning_rate=2e-4, num_generations=8, max_completion_length=48,
                max_tool_calling_iterations=8,
                seed=args.seed, bf16=False, use_cpu=True, gradient_checkpointing=False, save_strategy="no",
                report_to="none", logging_steps=1,
            ),
        )
        trainer.train()
    last = trainer.state.log_history[-2] if len(trainer.state.log_history) > 1 else {}
    print({k: v for k, v in last.items() if k.startswith(("reward", "rewards/", "tools/"))})
    return trainer.state.log_history


if __name__ == "__main__":
    main()
