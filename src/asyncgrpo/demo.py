"""`asyncgrpo demo`: RL on the bundled tiny model on a laptop, held-out accuracy before and after.

    embedded server (subprocess, CPU) <-- weights every step -- AsyncGRPOTrainer (this process)
           ^  rollouts                                              |
           '----------- rollout process: arithmetic prompts, accuracy_reward

Held-out accuracy is measured through the same server (sampling at temperature 1, several samples
per question) before training, every `eval_every` steps, and after, with the share of answers that
carry a `\\boxed{}` answer at all: the tiny model sometimes stops after its working without one (a
habit from its supervised data, see `scripts/build_tiny_model.py`), and RL on accuracy learns both to
box the answer and to get more of the arithmetic right. The output directory receives
`metrics.jsonl` (every logged step), `accuracy.json` and `reward_accuracy.png`.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import time
from pathlib import Path
from typing import Any, NamedTuple

from transformers import PrinterCallback, TrainerCallback

logger = logging.getLogger(__name__)

MODEL_ID = "asyncgrpo/tiny-chat"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from asyncgrpo.cli_args import at_least, server_url

    parser.add_argument("--output-dir", default="asyncgrpo-demo", help="Where metrics, plot and logs go.")
    parser.add_argument("--max-steps", type=at_least(1), default=60, help="Optimizer steps to train.")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--learning-rate", type=at_least(0, float), default=2e-4)
    parser.add_argument("--num-generations", type=at_least(2), default=8,
                        help="Completions per prompt (a group).")
    parser.add_argument("--num-train-prompts", type=at_least(1), default=2000)
    parser.add_argument("--num-eval-prompts", type=at_least(1), default=200)
    parser.add_argument("--eval-samples", type=at_least(1), default=4, help="Samples per held-out question.")
    parser.add_argument("--eval-every", type=at_least(0), default=10,
                        help="Steps between held-out evaluations (0: only before and after training).")
    parser.add_argument("--max-staleness", type=at_least(0), default=4)
    parser.add_argument("--server-url", type=server_url, default=None,
                        help="Use this running server instead of starting one.")
    parser.add_argument("--model", default=MODEL_ID,
                        help="Model id, folder or .gguf file (default: the bundled tiny model).")


def run(args: argparse.Namespace) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from datasets import Dataset

    from asyncgrpo import AsyncGRPOConfig, AsyncGRPOTrainer
    from asyncgrpo.launch import EmbeddedServer
    from asyncgrpo.rewards import accuracy_reward
    from asyncgrpo.tasks import arithmetic
    from asyncgrpo.train.model_setup import load_tokenizer

    torch.manual_seed(args.seed)
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    eval_rows = arithmetic.make_dataset(args.num_eval_prompts, seed=10_000 + args.seed)
    held_out = {row["prompt"][-1]["content"] for row in eval_rows}
    train_rows = arithmetic.make_dataset(args.num_train_prompts, seed=args.seed, exclude=held_out)
    tokenizer = load_tokenizer(args.model, trust_remote_code=False)

    server = None if args.server_url else EmbeddedServer(args.model, log_path=out / "server.log").start()
    url = args.server_url or server.url
    started = time.perf_counter()
    try:
        # the embedded server inherits VLLM_API_KEY, and the trainer's config reads it too
        evaluator = HeldOutAccuracy(url, tokenizer, eval_rows, samples=args.eval_samples, seed=args.seed,
                                    api_key=os.environ.get("VLLM_API_KEY") or None)
        before = evaluator()
        print(f"held-out accuracy before training: {before.accuracy:.1%} (answers boxed: {before.boxed:.1%})")
        config = AsyncGRPOConfig(
            output_dir=str(out / "trainer"),
            vllm_server_base_url=url,
            max_steps=args.max_steps,
            learning_rate=args.learning_rate,
            num_generations=args.num_generations,
            max_completion_length=48,
            max_staleness=args.max_staleness,
            seed=args.seed,
            bf16=False,
            use_cpu=not torch.cuda.is_available(),
            gradient_checkpointing=False,
            save_strategy="no",
            report_to="none",
            disable_tqdm=True,
            logging_steps=1,
        )
        progress = DemoProgress(out / "metrics.jsonl", evaluator, args.eval_every, args.max_steps, before)
        trainer = AsyncGRPOTrainer(
            model=args.model,
            reward_funcs=accuracy_reward,
            train_dataset=Dataset.from_list(train_rows),
            args=config,
            processing_class=tokenizer,
            callbacks=[progress],
        )
        # the progress bar shows the run; metrics.jsonl has every log
        trainer.remove_callback(PrinterCallback)
        trainer.train()
        after = evaluator()
        progress.close(after, trainer.state.global_step)
    finally:
        if server is not None:
            server.stop()
    wall_s = time.perf_counter() - started
    result = {"accuracy_before": before.accuracy, "accuracy_after": after.accuracy,
              "boxed_before": before.boxed, "boxed_after": after.boxed, "steps": args.max_steps,
              "wall_s": wall_s, "seed": args.seed, "eval_prompts": len(eval_rows),
              "eval_samples": args.eval_samples}
    (out / "accuracy.json").write_text(json.dumps(result, indent=2))
    gain = (after.accuracy - before.accuracy) * 100
    print(f"held-out accuracy: {before.accuracy:.1%} -> {after.accuracy:.1%} ({gain:+.1f} points) in "
          f"{wall_s:.0f}s; answers boxed: {before.boxed:.1%} -> {after.boxed:.1%}")
    plot_path = plot(out / "metrics.jsonl", out / "reward_accuracy.png")
    print(f"metrics: {out / 'metrics.jsonl'}" + (f"\nplot: {plot_path}" if plot_path else ""))
    return 0


class HeldOut(NamedTuple):
    accuracy: float  # fraction of correct `\\boxed{}` answers
    boxed: float  # fraction of answers with a `\\boxed{}` at all


class HeldOutAccuracy:
    """Held-out questions sampled through the server: how many answers are right, how many boxed.

    Rows carry the integer `answer` (`asyncgrpo.tasks.arithmetic` and `word_problems` rows); an answer is
    right when its last `\\boxed{}` holds exactly that integer. Each question is sampled `samples` times at
    `temperature`, with seeds derived from `seed`, so the same weights give the same number.
    """

    def __init__(
        self, url: str, tokenizer: Any, rows: list[dict], *, samples: int, seed: int,
        api_key: str | None = None, max_tokens: int = 48, temperature: float = 1.0,
    ) -> None:
        self.url = url
        self.api_key = api_key
        self.tokenizer = tokenizer
        self.rows = rows
        self.samples = samples
        self.seed = seed
        self.max_tokens = max_tokens
        self.temperature = temperature

    def __call__(self) -> HeldOut:
        from asyncgrpo.evaluate import evaluate, last_message_text
        from asyncgrpo.tasks import arithmetic

        boxed: list[bool] = []

        def score(row: dict, rollout) -> float:
            text = last_message_text(rollout)
            boxed.append(arithmetic.extract_boxed(text) is not None)
            return float(arithmetic.is_correct(text, row["answer"]))

        accuracy = evaluate(
            self.url, self.tokenizer, self.rows, samples=self.samples, seed=self.seed,
            max_tokens=self.max_tokens, temperature=self.temperature, score=score, api_key=self.api_key,
        )
        return HeldOut(accuracy, sum(boxed) / max(1, len(boxed)))


class DemoProgress(TrainerCallback):
    """A progress bar with the reward, metrics to JSONL, and held-out accuracy every few steps."""

    def __init__(self, path: Path, evaluator: HeldOutAccuracy, eval_every: int, max_steps: int,
                 before: HeldOut) -> None:
        from tqdm.auto import tqdm

        self.file = open(path, "w")  # noqa: SIM115 -- open for the whole run, closed in close()
        self.evaluator = evaluator
        self.eval_every = eval_every
        self.bar = tqdm(total=max_steps, desc="training", unit="step")
        self.last_reward = float("nan")
        self.accuracy = before.accuracy
        self._write_held_out(0, before)

    def _write_held_out(self, step: int, result: HeldOut) -> None:
        self._write({"step": step, "heldout_accuracy": result.accuracy, "heldout_boxed": result.boxed})

    def _write(self, record: dict) -> None:
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()

    def on_log(self, args, state, control, logs=None, **kwargs):
        logs = dict(logs or {})
        self.last_reward = logs.get("reward", self.last_reward)
        self._write({"step": state.global_step, **logs})

    def on_step_end(self, args, state, control, **kwargs):
        if (self.eval_every and state.global_step % self.eval_every == 0
                and state.global_step < state.max_steps):
            result = self.evaluator()
            self.accuracy = result.accuracy
            self._write_held_out(state.global_step, result)
        self.bar.update(1)
        self.bar.set_postfix(reward=f"{self.last_reward:.2f}", heldout_acc=f"{self.accuracy:.1%}")

    def close(self, after: HeldOut, step: int) -> None:
        self._write_held_out(step, after)
        self.bar.close()
        self.file.close()


def plot(metrics_path: Path, png_path: Path) -> Path | None:
    """Reward and held-out accuracy against steps; None (with a note) when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (pip install 'asyncgrpo[plot]')")
        return None
    records = [json.loads(line) for line in metrics_path.read_text().splitlines() if line.strip()]
    reward = [(r["step"], r["reward"]) for r in records if "reward" in r]
    accuracy = [(r["step"], r["heldout_accuracy"]) for r in records if "heldout_accuracy" in r]
    boxed = [(r["step"], r["heldout_boxed"]) for r in records if "heldout_boxed" in r]
    fig, ax = plt.subplots(figsize=(7, 4))
    if reward:
        ax.plot(*zip(*reward), label="reward (rollouts)", alpha=0.7)
    if accuracy:
        ax.plot(*zip(*accuracy), "o-", label="held-out accuracy")
    if boxed:
        ax.plot(*zip(*boxed), "s--", label="held-out answers boxed", alpha=0.7)
    ax.set_xlabel("optimizer step")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend()
    ax.set_title("asyncgrpo demo: tiny-chat on arithmetic")
    fig.tight_layout()
    fig.savefig(png_path, dpi=120)
    plt.close(fig)
    return png_path
