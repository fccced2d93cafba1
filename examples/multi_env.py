"""Several environments in one run, routed by the dataset's `environment` column.

Counter rows run in `CounterEnv` (its `increment` tool, scored by its `get_reward`); arithmetic rows
run in `ArithmeticEnv` (no tools, scored by `accuracy_reward`, which returns None -- not applicable --
on counter rows). Each rollout sees only its own environment's tools. Runs on CPU with the bundled
tiny model and the embedded server; 10 steps take a minute or two:

    python examples/multi_env.py --max-steps 10
"""

from __future__ import annotations

import argparse
import os
import random

from datasets import Dataset

from asyncgrpo import AsyncGRPOConfig, AsyncGRPOTrainer
from asyncgrpo.cli import at_least
from asyncgrpo.launch import EmbeddedServer
from asyncgrpo.rewards import accuracy_reward
from asyncgrpo.tasks import arithmetic, counter
from asyncgrpo.tasks.counter import IncrementEnv as CounterEnv  # increment tool + get_reward

MODEL = "asyncgrpo/tiny-chat"


class ArithmeticEnv:
    def reset(self, **kwargs) -> None:  # the dataset row already holds the question
        return None


def mixed_rows(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for row in arithmetic.make_dataset(n // 2, seed=seed):
        rows.append({"prompt": row["prompt"], "answer": row["answer"], "target": None, "max_step": None,
                     "environment": "arithmetic"})
    for row in counter.make_dataset(n - n // 2, seed=seed):
        rows.append({"prompt": row["prompt"], "answer": None, "target": row["target"],
                     "max_step": row.get("max_step"), "environment": "counter"})
    rng.shuffle(rows)
    return rows


def main(argv: list[str] | None = None) -> list[dict]:
    """Train; returns the Trainer's log history."""
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-steps", type=at_least(1), default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output-dir", default="asyncgrpo-multi-env")
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    with EmbeddedServer(MODEL) as server:
        trainer = AsyncGRPOTrainer(
            model=MODEL,
            reward_funcs=accuracy_reward,
            train_dataset=Dataset.from_list(mixed_rows(400, args.seed)),
            environment_factory={"counter": CounterEnv, "arithmetic": ArithmeticEnv},
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
    print({k: v for k, v in last.items() if k.startswith(("reward", "rewards/", "tools/", "env/"))})
    return trainer.state.log_history


if __name__ == "__main__":
    main()
