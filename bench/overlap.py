"""Overlap benchmark: the same training work, asynchronous vs strictly on-policy.

Both runs train the same model on the same prompts for the same number of optimizer steps against
the embedded server. `max_staleness=4` lets generation run ahead of training; `max_staleness=0`
makes every rollout wait for the weights of the previous step (generation and training alternate).
The ratio of wall-clock per step is the overlap speedup.

The two settings run `--repeats` times, interleaved (async, on-policy, async, ...), against one server,
and the medians are compared: on a shared machine the load drifts, and interleaving spreads it over
both. Per-step times compare equal work only as far as the steps train as many tokens, so the trained
tokens per step and per second are reported too.

    python bench/overlap.py                        # CPU, bundled tiny model
    python bench/overlap.py --device cuda --server-device cuda:1   # trainer on GPU 0, server on GPU 1

Writes bench/results/overlap_<device>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def run_once(args: argparse.Namespace, url: str, max_staleness: int, out_dir: Path) -> dict:
    import torch

    from asyncgrpo import AsyncGRPOConfig, AsyncGRPOTrainer
    from asyncgrpo.rewards import accuracy_reward
    from asyncgrpo.tasks import arithmetic

    dataset = arithmetic.make_dataset(args.prompts, seed=args.seed)  # a list of rows works as a dataset
    config = AsyncGRPOConfig(
        output_dir=str(out_dir / f"staleness{max_staleness}"),
        vllm_server_base_url=url,
        max_steps=args.steps,
        max_staleness=max_staleness,
        learning_rate=1e-5,
        num_generations=args.num_generations,
        max_completion_length=48,
        gradient_accumulation_steps=args.grad_accum,
        token_budget=args.token_budget,
        bf16=args.device == "cuda",
        use_cpu=args.device == "cpu",
        gradient_checkpointing=False,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        logging_steps=1,
        seed=args.seed,
    )
    trainer = AsyncGRPOTrainer(model=args.model, reward_funcs=accuracy_reward, train_dataset=dataset,
                               args=config)
    t0 = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - t0
    logs = [e for e in trainer.state.log_history if "perf/step_s" in e]
    steady = logs[args.warmup_steps:] or logs
    del trainer
    if torch.cuda.is_available():
        torch.cuda.empty_cache()

    def mean(key: str) -> float:
        values = [e[key] for e in steady if key in e]
        return statistics.fmean(values) if values else float("nan")

    return {
        "max_staleness": max_staleness,
        "steps": len(logs),
        "wall_s": wall,
        "step_s_mean": mean("perf/step_s"),
        "rollout_wait_s_mean": mean("perf/rollout_wait_s"),
        "backpressure_s_mean": mean("rollout/backpressure_s"),
        "fwd_bwd_s_mean": mean("perf/fwd_bwd_s"),
        "weight_sync_s_mean": mean("perf/weight_sync_s"),
        "staleness_mean": mean("sample/staleness_mean"),
        "samples_per_step": mean("batch/samples_per_step"),
        "trained_tokens_per_step": mean("batch/trained_tokens_per_step"),
        "trained_tokens_per_s": mean("perf/wall_clock_trained_tokens_per_s"),
        "reward_mean": mean("reward"),
    }


def medians(runs: list[dict]) -> dict:
    """Per-key median over repeated runs of one setting."""
    keys = [k for k, v in runs[0].items()
            if isinstance(v, (int, float)) and k not in ("max_staleness", "repeat")]
    return {"max_staleness": runs[0]["max_staleness"], "repeats": len(runs),
            **{k: statistics.median(r[k] for r in runs) for k in keys}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="asyncgrpo/tiny-chat")
    parser.add_argument("--device", default="cpu", help="The trainer's device (cpu or cuda).")
    parser.add_argument("--server-device", default=None,
                        help="The embedded server's device (default: --device), e.g. cuda:1 beside a trainer "
                        "on cuda:0.")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup-steps", type=int, default=2)
    parser.add_argument("--prompts", type=int, default=512)
    parser.add_argument("--num-generations", type=int, default=8)
    parser.add_argument("--grad-accum", type=int, default=1)
    parser.add_argument("--token-budget", type=int, default=1024)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=3,
                        help="Interleaved pairs of runs; medians are compared.")
    parser.add_argument("--server-url", default=None, help="A running server instead of starting one.")
    parser.add_argument("--out", default="bench/results")
    args = parser.parse_args()

    from asyncgrpo.launch import EmbeddedServer

    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    work = Path("/tmp/asyncgrpo-overlap")
    server = None if args.server_url else EmbeddedServer(
        args.model, device=args.server_device or args.device, log_path=work / "server.log").start()
    url = args.server_url or server.url
    load_before = os.getloadavg()
    runs = []
    try:
        for repeat in range(args.repeats):
            for staleness in (4, 0):
                runs.append({"repeat": repeat, **run_once(args, url, staleness, work / f"repeat{repeat}")})
    finally:
        if server is not None:
            server.stop()
    asynchronous = medians([r for r in runs if r["max_staleness"] == 4])
    on_policy = medians([r for r in runs if r["max_staleness"] == 0])
    speedup = on_policy["step_s_mean"] / asynchronous["step_s_mean"]
    throughput_ratio = asynchronous["trained_tokens_per_s"] / on_policy["trained_tokens_per_s"]
    print(f"{'':22}{'step_s':>8}{'rollout_wait_s':>16}{'backpressure_s':>16}{'fwd_bwd_s':>11}{'sync_s':>8}"
          f"{'trained_tok/step':>18}{'trained_tok/s':>15}")
    rows = [(f"#{r['repeat']} staleness {r['max_staleness']}", r) for r in runs]
    rows += [("median async (4)", asynchronous), ("median on-policy (0)", on_policy)]
    for name, r in rows:
        print(f"{name:22}{r['step_s_mean']:>8.3f}{r['rollout_wait_s_mean']:>16.3f}{r['backpressure_s_mean']:>16.3f}"
              f"{r['fwd_bwd_s_mean']:>11.3f}{r['weight_sync_s_mean']:>8.3f}{r['trained_tokens_per_step']:>18.0f}"
              f"{r['trained_tokens_per_s']:>15.0f}")
    print(f"overlap speedup (median on-policy step time / median async step time): {speedup:.2f}x; "
          f"trained tokens per second, async / on-policy: {throughput_ratio:.2f}x")
    result = {
        "benchmark": "overlap",
        "command": "python bench/overlap.py " + " ".join(f"--{k.replace('_', '-')} {v}"
                                                        for k, v in vars(args).items()
                                                        if v is not None and k != "out"),
        "device": args.device,
        "host": platform.node(),
        "cpu_count": os.cpu_count(),
        "load_average_1m": {"before": load_before[0], "after": os.getloadavg()[0]},
        "runs": runs,
        "median": {"async": asynchronous, "on_policy": on_policy},
        "speedup": speedup,
        "trained_tokens_per_s_ratio": throughput_ratio,
    }
    path = out_dir / f"overlap_{args.device}.json"
    path.write_text(json.dumps(result, indent=2))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
