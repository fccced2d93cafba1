"""Does a real pretrained model learn, and how fast: held-out accuracy against wall clock on one GPU.

SmolLM2-135M-Instruct (its GGUF file, converted once) on the recipe of examples/real_model.py (arithmetic or
word problems, accuracy + format rewards), with the embedded server inside the trainer's process and weights
moving by CUDA IPC. Settings:

    async       AsyncGRPOTrainer, max_staleness=4 (generation overlaps training)
    on_policy   AsyncGRPOTrainer, max_staleness=0 (every sample from the weights being trained)
    trl         TRL's GRPOTrainer with transformers generation (`pip install trl`; --trl-generation says
                whether generate() or the continuous batching engine), the same model, rows,
                rewards, group size, learning rate, temperature, completion length and seed, and
                --trl-prompts-per-step prompts a step (asyncgrpo's steps take as many groups as
                --token-budget x --grad-accum hold: `mean_groups_per_step` in each run)

One server serves every run: a run's trainer pushes its starting weights when it starts. Per seed the
settings alternate. With --concurrent, every setting and seed runs at the same time instead, one process
(and server) each: every run then shares the GPU with the same others, whatever its setting
(`concurrent_processes` in the JSON), which makes a multi-seed comparison of small models affordable.
Each run trains for --train-seconds of wall clock, counted from train() (the rollout process's start-up
included) to the first step end past it.

Held-out accuracy is not measured during a run: at the first step end past every --snapshot-seconds the
weights are copied to host memory (the copy's time is left out of the clock), and after the run each copy
is pushed to the server and its held-out questions are sampled there. So no run pauses for an evaluation,
and an asynchronous run's rollout process gets no generation time the clock does not see.

Per setting the JSON gives `gain_points` (final minus initial held-out accuracy, in points, mean and per
seed), and for `async` (and `trl`) `time_to_onpolicy_final_ratio`: the time the run took to first reach the
on-policy run's final accuracy over the on-policy run's time (per seed, and on the seed-mean curves); no
run may diverge (loss, gradient norm and weights finite; accuracy never falling 10 points below the run's
best at its end). Written after every run (so an interrupted bench keeps what finished), with the command,
and a PNG of the curves beside it.

    python bench/learning_gpu.py --seeds 0 1 2 --train-seconds 240            # async and on-policy
    python bench/learning_gpu.py --seeds 0 --settings trl --out bench/results/learning_gpu_h100.json
    python bench/learning_gpu.py --device cpu --model asyncgrpo/tiny-chat --train-seconds 20 --seeds 0  # CPU
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
from provenance import command_line, package_versions
from transformers import TrainerCallback

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
import real_model  # noqa: E402 -- found through the path set above

logger = logging.getLogger("learning_gpu")

STALENESS = {"async": 4, "on_policy": 0}
SETTINGS = (*STALENESS, "trl")
COLLAPSE_POINTS = 10.0  # a run "collapses" when it ends this far below its own best held-out accuracy


class Snapshots(TrainerCallback):
    """Stops training after `train_s` seconds of wall clock and keeps the weights at the first step end past
    every `every_s` seconds (in host memory; the time the copies take is left out of the clock)."""

    def __init__(self, train_s: float, every_s: float) -> None:
        self.train_s = train_s
        self.every_s = every_s
        self.started = 0.0
        self.paused_s = 0.0
        self.taken: list[dict] = []  # {"t_s", "step", "state"}
        self.history: list[dict] = []  # the trainer's log, kept here so that a run that fails still has it

    def elapsed(self) -> float:
        return time.perf_counter() - self.started - self.paused_s

    def start(self) -> None:
        """Call right before train(): the clock starts there."""
        self.started, self.paused_s, self.taken = time.perf_counter(), 0.0, []
        # what the process holds before its first step: the model, and the embedded server's weights,
        # KV cache and graphs (the peaks in `memory_gib` less this are the training steps')
        self.cuda_reserved_at_start = torch.cuda.memory_reserved() if torch.cuda.is_initialized() else None

    def on_step_end(self, args, state, control, model=None, **kwargs):
        self.history = state.log_history
        t = self.elapsed()
        done = t >= self.train_s
        if done or t >= self.every_s * (len(self.taken) + 1):
            copy_started = time.perf_counter()
            weights = {
                name: tensor.detach().to("cpu", copy=True) for name, tensor in model.state_dict().items()
            }
            self.taken.append({"t_s": t, "step": state.global_step, "state": weights})
            self.paused_s += time.perf_counter() - copy_started
        if done:
            control.should_training_stop = True


class SnapshotEvaluator:
    """Pushes snapshots to the server through the trainer's own weight push and samples the held-out set."""

    def __init__(self, url: str, model_path: str, device: str, evaluator: Any) -> None:
        from asyncgrpo.modeling.load import load_causal_lm

        self.url = url
        self.device = torch.device(device)
        self.evaluator = evaluator
        self.model = load_causal_lm(model_path, dtype=torch.float32, device=self.device)

    def __call__(self, snapshots: list[dict], label: str) -> list[dict]:
        from asyncgrpo.train.server_link import ServerLink
        from asyncgrpo.train.serving import serving_dtype
        from asyncgrpo.train.weights.choose import full_weight_transport
        from asyncgrpo.types import WeightVersion

        link = ServerLink(self.url, timeout_s=300)
        points = []
        try:
            info = link.connect()
            transport = full_weight_transport(link, self.device, serving_dtype(info), info.device)
            transport.init()
            try:
                for i, snap in enumerate(snapshots):
                    self.model.load_state_dict(snap["state"])
                    transport.push(self.model, WeightVersion(i))
                    started = time.perf_counter()
                    held_out = self.evaluator()
                    points.append(
                        {
                            "t_s": round(snap["t_s"], 2),
                            "step": snap["step"],
                            "accuracy": held_out.accuracy,
                            "boxed": held_out.boxed,
                            "eval_s": round(time.perf_counter() - started, 2),
                        }
                    )
                    print(
                        f"    t={snap['t_s']:6.1f}s step {snap['step']:4d}: held-out {held_out.accuracy:.1%} "
                        f"(boxed {held_out.boxed:.1%})",
                        flush=True,
                    )
            finally:
                transport.close()
        finally:
            link.close()
        return points


def train_asyncgrpo(
    args: argparse.Namespace,
    setting: str,
    seed: int,
    url: str,
    rows: list[dict],
    tokenizer: Any,
    snapshots: Snapshots,
    work: Path,
) -> dict:
    from asyncgrpo import AsyncGRPOTrainer

    config = real_model.make_config(
        args,
        url,
        cuda=args.device != "cpu",
        output_dir=str(work / f"{setting}-{seed}"),
        max_staleness=STALENESS[setting],
        seed=seed,
        max_steps=100_000,
    )
    trainer = AsyncGRPOTrainer(
        model=args.model,
        reward_funcs=real_model.REWARD_FUNCS,
        train_dataset=rows,
        args=config,
        processing_class=tokenizer,
        callbacks=[snapshots],
    )
    snapshots.start()
    trainer.train()
    return finish(trainer, snapshots)


def train_trl(
    args: argparse.Namespace, seed: int, rows: list[dict], tokenizer: Any, snapshots: Snapshots, work: Path
) -> dict:
    """TRL's GRPOTrainer on the same model, rows and rewards (generation with transformers on the GPU)."""
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from asyncgrpo.modeling.load import load_causal_lm

    # one optimizer step per generation round, over --grad-accum micro-batches as asyncgrpo's steps
    completions = args.trl_prompts_per_step * args.num_generations
    config = GRPOConfig(
        output_dir=str(work / f"trl-{seed}"),
        learning_rate=args.learning_rate,
        num_generations=args.num_generations,
        per_device_train_batch_size=completions // args.grad_accum,
        gradient_accumulation_steps=args.grad_accum,
        max_completion_length=real_model.TASKS[args.task]["max_completion_length"],
        temperature=args.temperature,
        max_steps=100_000,
        seed=seed,
        bf16=args.device != "cpu",
        use_cpu=args.device == "cpu",
        gradient_checkpointing=False,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        beta=0.0,
        use_vllm=False,
        use_transformers_continuous_batching=args.trl_generation == "continuous_batching",
    )
    model = load_causal_lm(args.model, dtype=torch.float32)
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=real_model.REWARD_FUNCS,
        train_dataset=Dataset.from_list(rows),
        args=config,
        processing_class=tokenizer,
        callbacks=[snapshots],
    )
    snapshots.start()
    trainer.train()
    return finish(trainer, snapshots)


def finish(trainer: Any, snapshots: Snapshots) -> dict:
    """What a run leaves besides its snapshots: time, steps, the logged curves, whether it stayed finite."""
    history = trainer.state.log_history
    log, nonfinite = logged(history)
    weights_finite = all(bool(torch.isfinite(p).all()) for p in trainer.model.parameters())
    groups = [e["batch/groups_per_step"] for e in history if "batch/groups_per_step" in e]
    return {
        "train_s": round(snapshots.elapsed(), 2),
        "steps": trainer.state.global_step,
        "log": log,
        "nonfinite_logged": nonfinite,
        "weights_finite": weights_finite,
        "mean_groups_per_step": statistics.fmean(groups) if groups else None,
        "memory_gib": memory_gib(trainer, snapshots.cuda_reserved_at_start),
    }


def failed(exc: BaseException, snapshots: Snapshots) -> dict:
    """A run that raised: the error, and what it logged before. A loss or gradient norm that turned
    non-finite before the error is a divergence (NaN weights then fail the next sampling step)."""
    log, nonfinite = logged(snapshots.history)
    first_bad = next((e for e in log for k in nonfinite if not math.isfinite(float(e.get(k, 0.0)))), None)
    return {
        "status": "failed",
        "error": f"{type(exc).__name__}: {exc}"[:2000],
        "train_s": round(snapshots.elapsed(), 2) if snapshots.started else None,
        "steps": log[-1]["step"] if log else 0,
        "log": log,
        "nonfinite_logged": nonfinite,
        "diverged_at_step": None if first_bad is None else first_bad["step"],
    }


def logged(history: list[dict]) -> tuple[list[dict], list[str]]:
    """The log entries a run keeps (one per step), and which of loss and gradient norm went non-finite."""
    keep = (
        "loss",
        "reward",
        "grad_norm",
        "perf/step_s",
        "perf/fwd_bwd_mfu",
        "perf/rollout_wait_s",
        "perf/weight_sync_s",
        "frac_reward_zero_std",
        "num_tokens",
        "sample/dropped_stale_count",
        "batch/groups_per_step",
        "completions/mean_length",
        "sampling/sampling_logp_difference/max",
        "rewards/accuracy_reward/mean",
        "rewards/boxed_format_reward/mean",
    )
    log = [{"step": e.get("step"), **{k: e[k] for k in keep if k in e}} for e in history if "loss" in e]
    nonfinite = [k for e in log for k in ("loss", "grad_norm") if k in e and not math.isfinite(float(e[k]))]
    return log, sorted(set(nonfinite))


def memory_gib(trainer: Any, cuda_reserved_at_start: int | None = None) -> dict[str, float]:
    """Where the trainer's memory goes: its weights, gradients and optimizer state, and on CUDA what the
    process held before its first step and its peaks (the embedded server in this process included: its
    weights, KV cache and graphs)."""
    gib = 2**30
    params = list(trainer.model.parameters())
    state = getattr(trainer.optimizer, "state", {}) if trainer.optimizer is not None else {}
    found = {
        "weights": sum(p.numel() * p.element_size() for p in params) / gib,
        "gradients": sum(p.grad.numel() * p.grad.element_size() for p in params if p.grad is not None) / gib,
        "optimizer_state": sum(t.numel() * t.element_size() for s in state.values() for t in s.values()
                               if torch.is_tensor(t)) / gib,
    }
    device = params[0].device
    if device.type == "cuda":
        found["cuda_max_allocated"] = torch.cuda.max_memory_allocated(device) / gib
        found["cuda_max_reserved"] = torch.cuda.max_memory_reserved(device) / gib
        if cuda_reserved_at_start is not None:
            found["cuda_reserved_at_start"] = cuda_reserved_at_start / gib
    return {k: round(v, 3) for k, v in found.items()}


def first_time_reaching(curve: list[dict], accuracy: float) -> float | None:
    for point in curve:
        if point["accuracy"] >= accuracy:
            return point["t_s"]
    return None


def mean_curve(curves: list[list[dict]]) -> list[dict]:
    """Seed-mean accuracy at each snapshot index (snapshots are taken at the same times within a setting)."""
    length = min(len(c) for c in curves)
    return [
        {
            "t_s": statistics.fmean(c[i]["t_s"] for c in curves),
            "accuracy": statistics.fmean(c[i]["accuracy"] for c in curves),
        }
        for i in range(length)
    ]


def failure(run: dict) -> str:
    if run.get("diverged_at_step") is not None:
        return f"diverged at step {run['diverged_at_step']}"
    return (run.get("error") or "failed").splitlines()[0][:300]


def summarize(report: dict) -> dict:
    runs = [r for r in report["runs"] if r.get("status") == "ok"]
    initial = report["initial"]["accuracy"]
    summary: dict[str, Any] = {}
    by_setting = {s: {r["seed"]: r for r in runs if r["setting"] == s} for s in SETTINGS}
    for setting, seeds in by_setting.items():
        # runs that raised: a divergence that ended in an error, or the error's first line (out of memory...)
        fails = {r["seed"]: failure(r) for r in report["runs"]
                 if r["setting"] == setting and r.get("status") == "failed"}
        if fails:
            summary.setdefault("failed", {})[setting] = fails
        if not seeds:
            continue
        gains = {seed: (r["curve"][-1]["accuracy"] - initial) * 100 for seed, r in seeds.items()}
        diverged = {seed: r["diverged"] for seed, r in seeds.items() if r["diverged"]}
        entry = {
            "seeds": sorted(seeds),
            "gain_points": statistics.fmean(gains.values()),
            "gain_points_per_seed": gains,
            "final_accuracy": statistics.fmean(r["curve"][-1]["accuracy"] for r in seeds.values()),
            "train_s": statistics.fmean(r["train_s"] for r in seeds.values()),
            "steps": statistics.fmean(r["steps"] for r in seeds.values()),
            "diverged": diverged,
        }
        on_policy = by_setting["on_policy"]
        if setting != "on_policy" and on_policy:
            ratios = {}
            for seed, r in seeds.items():
                if seed in on_policy:
                    reference = on_policy[seed]
                    reached = first_time_reaching(r["curve"], reference["curve"][-1]["accuracy"])
                    ratios[seed] = None if reached is None else reached / reference["train_s"]
            mine, theirs = (
                mean_curve([r["curve"] for r in seeds.values()]),
                mean_curve([r["curve"] for r in on_policy.values()]),
            )
            reached = first_time_reaching(mine, theirs[-1]["accuracy"])
            entry["time_to_onpolicy_final_ratio"] = None if reached is None else reached / theirs[-1]["t_s"]
            entry["time_to_onpolicy_final_ratio_per_seed"] = ratios
        summary[setting] = entry
    if "async" in summary and "trl" in summary:
        summary["async_vs_trl"] = time_to_common_accuracy(by_setting["async"], by_setting["trl"])
    return summary


def time_to_common_accuracy(async_runs: dict, trl_runs: dict) -> dict:
    """The lower of the two seed-mean final accuracies (which both reach) and the time each setting's
    seed-mean curve took to first reach it."""
    mine = mean_curve([r["curve"] for r in async_runs.values()])
    theirs = mean_curve([r["curve"] for r in trl_runs.values()])
    common = min(mine[-1]["accuracy"], theirs[-1]["accuracy"])
    return {
        "accuracy": common,
        "async_s": first_time_reaching(mine, common),
        "trl_s": first_time_reaching(theirs, common),
    }


def plot(report: dict, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot")
        return
    colors = {"async": "tab:blue", "on_policy": "tab:orange", "trl": "tab:green"}
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    for setting in SETTINGS:
        curves = [r["curve"] for r in report["runs"] if r["setting"] == setting and r.get("status") == "ok"]
        if not curves:
            continue
        for curve in curves:
            ax.plot(
                [p["t_s"] for p in curve], [p["accuracy"] for p in curve], color=colors[setting], alpha=0.25
            )
        mean = mean_curve(curves)
        ax.plot(
            [p["t_s"] for p in mean],
            [p["accuracy"] for p in mean],
            "o-",
            color=colors[setting],
            label=f"{setting} (mean of {len(curves)})",
        )
    ax.set_xlabel("training wall clock (s)")
    ax.set_ylabel("held-out accuracy")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend()
    ax.set_title(f"{Path(report['model']).name}: {report['task']} on {report['gpu']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run_here(args: argparse.Namespace, report: dict, out: Path) -> None:
    """Every (seed, setting) run in this process, one after the other, against one server."""
    from asyncgrpo.launch import start_server
    from asyncgrpo.modeling.load import load_tokenizer

    cuda = args.device != "cpu"
    train_rows, eval_rows = real_model.task_rows(
        args.task, num_train=args.num_train_prompts, num_eval=args.eval_prompts, seed=0
    )
    tokenizer = load_tokenizer(args.model)
    work = Path(os.environ.get("TMPDIR", "/tmp")) / "asyncgrpo-learning-gpu"
    server = start_server(
        args.model,
        device=args.device,
        extra_args=real_model.server_flags(args.task, cuda, args.gpu_memory_utilization),
    )
    try:
        evaluator = real_model.held_out_accuracy(server.url, tokenizer, eval_rows, args)
        snapshot_eval = SnapshotEvaluator(server.url, args.model, args.device if cuda else "cpu", evaluator)
        started = time.perf_counter()
        initial = evaluator()  # the server serves the checkpoint as loaded
        report["initial"] = {
            "accuracy": initial.accuracy,
            "boxed": initial.boxed,
            "eval_s": round(time.perf_counter() - started, 2),
        }
        print(
            f"initial held-out accuracy {initial.accuracy:.1%} (boxed {initial.boxed:.1%}), "
            f"{report['initial']['eval_s']} s",
            flush=True,
        )
        for seed in args.seeds:
            for setting in args.settings:
                print(f"== {setting}, seed {seed}", flush=True)
                snapshots = Snapshots(args.train_seconds, args.snapshot_seconds)
                run: dict[str, Any] = {"setting": setting, "seed": seed}
                try:
                    if setting == "trl":
                        run.update(train_trl(args, seed, train_rows, tokenizer, snapshots, work))
                    else:
                        run.update(max_staleness=STALENESS[setting])
                        run.update(
                            train_asyncgrpo(
                                args, setting, seed, server.url, train_rows, tokenizer, snapshots, work
                            )
                        )
                    curve = [{"t_s": 0.0, "step": 0, "accuracy": initial.accuracy, "boxed": initial.boxed}]
                    curve += snapshot_eval(snapshots.taken, f"{setting}-{seed}")
                    best = max(point["accuracy"] for point in curve)
                    collapsed = (best - curve[-1]["accuracy"]) * 100 > COLLAPSE_POINTS
                    run.update(
                        status="ok",
                        curve=curve,
                        collapsed=collapsed,
                        diverged=bool(run["nonfinite_logged"]) or not run["weights_finite"] or collapsed,
                    )
                    print(
                        f"   {run['steps']} steps, {run['train_s']:.0f} s: {initial.accuracy:.1%} -> "
                        f"{curve[-1]['accuracy']:.1%}",
                        flush=True,
                    )
                except Exception as exc:  # recorded, and the next run goes on
                    logger.exception("%s seed %d failed", setting, seed)
                    run.update(failed(exc, snapshots))
                report["runs"].append(run)
                report["summary"] = summarize(report)
                out.write_text(json.dumps(report, indent=1) + "\n")
                del snapshots
                gc.collect()
                if cuda:
                    torch.cuda.empty_cache()
    finally:
        server.stop()


def run_concurrently(args: argparse.Namespace, report: dict, out: Path) -> None:
    """Every (setting, seed) at the same time, one process each (this script with one setting, one seed
    and its own server); their runs are gathered into `report`. Each run shares the GPU with the same
    others, whatever its setting, so the settings compare under equal contention."""
    work = Path(os.environ.get("TMPDIR", "/tmp")) / "asyncgrpo-learning-gpu"
    work.mkdir(parents=True, exist_ok=True)
    jobs = [(setting, seed) for setting in args.settings for seed in args.seeds]
    share = args.gpu_memory_utilization / len(jobs)
    children = []
    for setting, seed in jobs:
        child_out = work / f"{setting}-{seed}.json"
        child_out.unlink(missing_ok=True)
        cmd = [
            sys.executable,
            __file__,
            *sys.argv[1:],
            "--no-concurrent",
            "--settings",
            setting,
            "--seeds",
            str(seed),
            "--gpu-memory-utilization",
            f"{share:.3f}",
            "--out",
            str(child_out),
        ]
        log = open(work / f"{setting}-{seed}.log", "w")  # noqa: SIM115 -- closed below
        child = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        children.append((setting, seed, child_out, log, child))
    print(f"== {len(jobs)} runs at once: {args.settings} x seeds {args.seeds} (logs in {work})", flush=True)
    for setting, seed, child_out, log, child in children:
        child.wait()
        log.close()
        if not child_out.exists():
            tail = (work / f"{setting}-{seed}.log").read_text()[-2000:]
            report["runs"].append(
                {"setting": setting, "seed": seed, "status": "failed",
                 "error": f"exit {child.returncode}: {tail}"}
            )
            continue
        result = json.loads(child_out.read_text())
        report.setdefault("initial", result.get("initial"))
        report["runs"].extend(result["runs"])
        report["summary"] = summarize(report)
        out.write_text(json.dumps(report, indent=1) + "\n")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    real_model.add_arguments(p)
    p.add_argument("--settings", nargs="+", choices=SETTINGS, default=["async", "on_policy"])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--train-seconds", type=float, default=240.0, help="Wall clock each run trains for.")
    p.add_argument(
        "--snapshot-seconds", type=float, default=20.0, help="Held-out accuracy every this many seconds."
    )
    p.add_argument("--trl-prompts-per-step", type=int, default=16)
    p.add_argument(
        "--trl-generation",
        choices=("generate", "continuous_batching"),
        default="generate",
        help="TRL's generation without vLLM: transformers' generate(), or its continuous batching "
        "engine (the faster of the two).",
    )
    p.add_argument("--gpu-memory-utilization", type=float, default=0.3, help="The embedded server's share.")
    p.add_argument(
        "--concurrent",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="Run the seeds of a setting at the same time, one process each (its own server, with "
        "--gpu-memory-utilization split between them), one setting after the other.",
    )
    p.add_argument(
        "--out",
        default=None,
        help="JSON path (default bench/results/learning_gpu_<gpu>.json); runs "
        "already in it for other settings are kept.",
    )
    args = p.parse_args()
    if "trl" in args.settings and (args.trl_prompts_per_step * args.num_generations) % args.grad_accum:
        p.error(
            f"TRL's step is --trl-prompts-per-step x --num-generations = "
            f"{args.trl_prompts_per_step * args.num_generations} completions in --grad-accum "
            f"{args.grad_accum} micro-batches: choose values whose product divides evenly"
        )
    args.model = args.model or real_model.smollm2_gguf()
    cuda = args.device != "cpu"
    gpu = torch.cuda.get_device_name().split()[1].lower() if cuda else "cpu"
    out = Path(args.out or ROOT / "bench" / "results" / f"learning_gpu_{gpu}.json")
    logging.basicConfig(level=logging.WARNING)

    report: dict[str, Any] = json.loads(out.read_text()) if out.exists() else {}
    report["runs"] = [r for r in report.get("runs", []) if r["setting"] not in args.settings]
    if "trl" in args.settings:
        report["trl"] = {"generation": args.trl_generation, "prompts_per_step": args.trl_prompts_per_step}
    report.update(
        {
            "gpu": torch.cuda.get_device_name() if cuda else platform.processor() or "cpu",
            "model": args.model,
            "task": args.task,
            "packages": package_versions(),
            "recipe": {
                k: getattr(args, k)
                for k in (
                    "temperature",
                    "learning_rate",
                    "num_generations",
                    "token_budget",
                    "grad_accum",
                    "eval_prompts",
                    "eval_samples",
                    "torch_compile",
                )
            },
            "train_seconds": args.train_seconds,
            "snapshot_seconds": args.snapshot_seconds,
        }
    )
    report.setdefault("commands", {})
    for setting in args.settings:
        report["commands"][setting] = command_line()
    report["concurrent_processes"] = len(args.seeds) * len(args.settings) if args.concurrent else 1
    if args.concurrent:
        run_concurrently(args, report, out)
    else:
        run_here(args, report, out)
    plot(report, out.with_suffix(".png"))
    print(json.dumps(report["summary"], indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
