"""What a model gets right before any training, per problem kind: the measurements behind the defaults of
examples/real_model.py (instruction, temperature, task mix, completion length).

For each task, instruction and temperature: held-out accuracy and the share of answers with one box holding
a number (what the recipe's format reward pays for), overall and per kind, and the mean completion length,
sampled through the embedded server (in this process on CUDA), `--samples` replies per question. Writes
JSON (default bench/results/recipe_probe_<gpu>.json) with the command.

    python bench/recipe_probe.py                                  # SmolLM2-135M-Instruct's GGUF file
    python bench/recipe_probe.py --device cpu --questions 40 --temperatures 0.7
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
from provenance import command_line, package_versions

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
import real_model  # noqa: E402 -- found through the path set above

INSTRUCTIONS = {
    "none": "",
    "box": "Put the final answer in \\boxed{}.",
    "box_number": "Give the final answer as \\boxed{number}.",
    "steps_then_box": "Solve it step by step, then put the final answer in \\boxed{}.",
}


def probe(
    url: str, tokenizer, rows: list[dict], *, temperature: float, samples: int, max_tokens: int
) -> dict:
    from asyncgrpo.evaluate import evaluate_async, last_message_text
    from asyncgrpo.rewards import boxed_number_format_reward
    from asyncgrpo.tasks import arithmetic

    per_kind: dict[str, list[bool]] = defaultdict(list)
    boxed: list[bool] = []  # one box holding a number (the recipe's format reward)
    lengths: list[int] = []

    def score(row, rollout) -> float:
        text = last_message_text(rollout)
        right = arithmetic.is_correct(text, row["answer"])
        per_kind[row["kind"]].append(right)
        boxed.append(boxed_number_format_reward([text])[0] == 1.0)
        lengths.append(sum(len(turn.output_ids) for turn in rollout.turns))
        return float(right)

    started = time.perf_counter()
    accuracy = asyncio.run(
        evaluate_async(
            url,
            tokenizer,
            rows,
            score=score,
            samples=samples,
            temperature=temperature,
            max_tokens=max_tokens,
            seed=0,
            max_concurrency=512,
        )
    )
    return {
        "accuracy": accuracy,
        "boxed": statistics.fmean(boxed),
        "mean_completion_tokens": statistics.fmean(lengths),
        "per_kind": {k: statistics.fmean(v) for k, v in sorted(per_kind.items())},
        "seconds": round(time.perf_counter() - started, 2),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None)
    p.add_argument("--device", default="cuda")
    p.add_argument("--tasks", nargs="+", choices=sorted(real_model.TASKS), default=sorted(real_model.TASKS))
    p.add_argument("--instructions", nargs="+", choices=sorted(INSTRUCTIONS), default=sorted(INSTRUCTIONS))
    p.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 0.7, 1.0])
    p.add_argument("--questions", type=int, default=200)
    p.add_argument("--samples", type=int, default=4)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    model = args.model or real_model.smollm2_gguf()
    cuda = args.device != "cpu"
    gpu = torch.cuda.get_device_name().split()[1].lower() if cuda else "cpu"
    out = Path(args.out or ROOT / "bench" / "results" / f"recipe_probe_{gpu}.json")

    from asyncgrpo.launch import start_server
    from asyncgrpo.modeling.load import load_tokenizer

    tokenizer = load_tokenizer(model)
    longest = max(spec["max_completion_length"] for spec in real_model.TASKS.values())
    server = start_server(
        model, device=args.device, extra_args=real_model.server_flags("word_problems", cuda)
    )
    report = {
        "model": model,
        "gpu": torch.cuda.get_device_name() if cuda else "cpu",
        "command": command_line(),
        "packages": package_versions(),
        "questions": args.questions,
        "samples": args.samples,
        "instructions": {name: INSTRUCTIONS[name] for name in args.instructions},
        "results": [],
    }
    try:
        for task in args.tasks:
            for name in args.instructions:
                _, asked = real_model.task_rows(
                    task, num_train=1, num_eval=args.questions, seed=0, instruction=INSTRUCTIONS[name]
                )
                for temperature in args.temperatures:
                    result = probe(
                        server.url,
                        tokenizer,
                        asked,
                        temperature=temperature,
                        samples=1 if temperature == 0 else args.samples,
                        max_tokens=longest,
                    )
                    report["results"].append(
                        {"task": task, "instruction": name, "temperature": temperature, **result}
                    )
                    print(
                        f"{task:14s} {name:15s} T={temperature:.1f}: accuracy {result['accuracy']:.1%}, box "
                        f"{result['boxed']:.1%}, {result['mean_completion_tokens']:.0f} tokens; "
                        + ", ".join(f"{k} {v:.0%}" for k, v in result["per_kind"].items()),
                        flush=True,
                    )
                    out.write_text(json.dumps(report, indent=1) + "\n")
    finally:
        server.stop()
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
