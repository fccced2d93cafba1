"""Agent training with an environment: the seed's IncrementEnv on the bundled tiny model.

The model brings a counter to a target by calling the environment's `increment` tool; the
environment scores the episode from its own state (`get_reward`). The dataset owns the task: its
`target` and `max_step` columns reach `reset(**row)`. Runs on CPU in a few minutes:

    python examples/increment_env.py --max-steps 60 --seed 0

It prints the held-out success rate (counter exactly at the target) before and after training.
"""

from __future__ import annotations

import argparse
import json
import os
import time

from datasets import Dataset

from asyncgrpo import AsyncGRPOConfig, AsyncGRPOTrainer
from asyncgrpo.cli import at_least
from asyncgrpo.evaluate import evaluate
from asyncgrpo.launch import EmbeddedServer
from asyncgrpo.tasks import counter
from asyncgrpo.train.model_setup import load_tokenizer

MODEL = "asyncgrpo/tiny-chat"


class IncrementEnv:
    def reset(self, target, max_step=None, **kwargs) -> None:  # the row's columns arrive as keywords
        self.counter = 0
        self.target = int(target)
        self.max_step = max_step

    def get_reward(self) -> float:
        return float(self.counter == self.target)

    def increment(self, step: int) -> int:
        """
        Increment the internal counter.

        Args:
            step: Value to add to the counter.

        Returns:
            The updated counter value.
        """
        if self.max_step is not None and not 1 <= step <= self.max_step:
            raise ValueError(f"step must be between 1 and {self.max_step}, got {step}")
        self.counter += step
        return self.counter


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-steps", type=at_least(1), default=60)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--learning-rate", type=at_least(0, float), default=2e-4)
    parser.add_argument("--model", default=MODEL,
                        help="Model id, folder or .gguf file (default: the bundled tiny model).")
    parser.add_argument("--eval-rows", type=at_least(1), default=100)
    parser.add_argument("--eval-samples", type=at_least(1), default=4)
    parser.add_argument("--output-dir", default="asyncgrpo-increment")
    parser.add_argument("--result-json", default=None, help="Also write the before/after rates here.")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    eval_rows = counter.make_dataset(args.eval_rows, seed=10_000 + args.seed)
    train = Dataset.from_list(counter.make_dataset(2000, seed=args.seed))
    tokenizer = load_tokenizer(args.model, trust_remote_code=False)
    started = time.perf_counter()
    with EmbeddedServer(args.model, log_path=os.path.join(args.output_dir, "server.log")) as server:
        def success_rate() -> float:
            return evaluate(server.url, tokenizer, eval_rows, environment_factory=IncrementEnv,
                            samples=args.eval_samples, seed=args.seed, max_tokens=48)

        before = success_rate()
        print(f"held-out success before training: {before:.1%}")
        trainer = AsyncGRPOTrainer(
            model=args.model,
            train_dataset=train,
            environment_factory=IncrementEnv,
            processing_class=tokenizer,
            args=AsyncGRPOConfig(
                output_dir=args.output_dir, vllm_server_base_url=server.url, max_steps=args.max_steps,
                learning_rate=args.learning_rate, num_generations=8, max_completion_length=48,
                max_tool_calling_iterations=8, seed=args.seed, bf16=False, use_cpu=True,
                gradient_checkpointing=False, save_strategy="no", report_to="none", logging_steps=5,
            ),
        )
        trainer.train()
        after = success_rate()
    result = {"before": before, "after": after, "seed": args.seed, "steps": args.max_steps,
              "wall_s": time.perf_counter() - started}
    print(f"held-out success: {before:.1%} -> {after:.1%} ({(after - before) * 100:+.1f} points)")
    if args.result_json:
        with open(args.result_json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
