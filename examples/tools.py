"""Training with plain tools: sync and async functions exposed to the model.

Tools are module-level functions with type hints and Google-style docstrings (their JSON schema is
built from them); sync ones run in a thread pool, async ones are awaited. An unknown tool name or a
raising tool becomes a tool message carrying the error (counted in tools/*), never a crash.

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-steps", type=int, default=5)
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    with EmbeddedServer(MODEL) as server:
        trainer = AsyncGRPOTrainer(
            model=MODEL,
            reward_funcs=accuracy_reward,
            train_dataset=Dataset.from_list(arithmetic.make_dataset(500, seed=0)),
            tools=[multiply, async_add],
            args=AsyncGRPOConfig(
                output_dir="asyncgrpo-tools", vllm_server_base_url=server.url, max_steps=args.max_steps,
                learning_rate=2e-4, num_generations=8, max_completion_length=48, max_tool_calling_iterations=4,
                bf16=False, use_cpu=True, gradient_checkpointing=False, save_strategy="no", report_to="none",
                logging_steps=1,
            ),
        )
        trainer.train()
    last = trainer.state.log_history[-2] if len(trainer.state.log_history) > 1 else {}
    print({k: v for k, v in last.items() if k.startswith(("reward", "tools/"))})


if __name__ == "__main__":
    main()
