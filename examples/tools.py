"""Training with plain tools: sync and async functions exposed to the model.

Tools are module-level functions with type hints and Google-style docstrings (their JSON schema is
built from them); sync ones run in a thread pool, async ones are awaited. A malformed call, an unknown
tool name or a raising tool becomes a tool message carrying the error (counted in tools/*), never a
crash; `tool_error_penalty` makes such calls cost reward.

The bundled tiny model was trained with one tool only (the counter task's `increment`): it cannot use
these tools, its calls come out malformed and its answers wrong. A group still differs in how many
broken calls it makes, so a short run trains (the model learns to stop making them); that checks the
wiring on CPU. With a model that calls tools (--model, a local path or hub id) accuracy can move too.

    python examples/tools.py --max-steps 5
"""

from __future__ import annotations

import argparse
import asyncio
import os

from datasets import Dataset

from asyncgrpo import AsyncGRPOConfig, AsyncGRPOTrainer
from asyncgrpo.launch import EmbeddedServer
from asyncgrpo.rewards import accuracy_reward
from asyncgrpo.tasks import arithmetic

MODEL = "asyncgrpo/tiny-chat"


def multiply(a: int, b: int) -> int:
    """
    Multiplies two integers.

    Args:
        a: The first integer.
        b: The second integer.

    Returns:
        The product of the two integers.
    """
    return a * b


async def async_add(a: int, b: int) -> int:
    """
    Asynchronously adds two integers.

    Args:
        a: The first integer.
        b: The second integer.

    Returns:
        The sum of the two integers.
    """
    await asyncio.sleep(0)
    return a + b


def tool_error_penalty(completions: list[list[dict]], **kwargs) -> list[float]:
    """-1 per failed tool call: the tool loop answers each with a tool message starting "Error:"."""
    return [
        -float(sum(m["role"] == "tool" and str(m.get("content", "")).startswith("Error:") for m in completion))
        for completion in completions
    ]


def main(argv: list[str] | None = None) -> list[dict]:
    """Train; returns the Trainer's log history."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-steps", type=int, default=5)
    parser.add_argument("--model", default=MODEL)
    parser.add_argument("--output-dir", default="asyncgrpo-tools")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.model == MODEL:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
    with EmbeddedServer(args.model) as server:
        trainer = AsyncGRPOTrainer(
            model=args.model,
            reward_funcs=[accuracy_reward, tool_error_penalty],
            train_dataset=Dataset.from_list(arithmetic.make_dataset(500, seed=args.seed)),
            tools=[multiply, async_add],
            # a gentle rate: on the tiny model the penalty is the only signal, and at 2e-4 the model drops
            # every tool call within two steps, after which no group differs and nothing trains
            args=AsyncGRPOConfig(
                output_dir=args.output_dir, vllm_server_base_url=server.url, max_steps=args.max_steps,
                learning_rate=2e-5, num_generations=8, max_completion_length=48, max_tool_calling_iterations=4,
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
