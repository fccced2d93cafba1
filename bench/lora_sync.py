"""LoRA benchmark: merged full-weight sync vs adapter-only sync, and the generation cost of serving an
adapter, on a random Qwen3 with a LoRA (r=32) on every attention and MLP projection.

Per server (the embedded server, started here; with `--vllm-url` also a running vLLM 0.33):

    generation     the same requests (fixed prompts, one seed each, ignore_eos) to the base model and to
                   the adapter, alternating, `--reps` times after a warm-up wave each: generated tokens/s
                   (median) and slowdown = base / adapter. `identical_outputs` counts requests whose
                   tokens are the same under both: an adapter loaded but not applied gives all of them.
    adapter sync   the trainer's `AdapterSync.push` (write the PEFT folder, POST /v1/load_lora_adapter,
                   unload the version that left the window, max_staleness 1): write / load / total
                   seconds and bytes; the first load (before the generation phase) is kept apart
    merged sync    the trainer's push of the PEFT model (merged into the base weights for the copy)
                   through the full-weight transport the trainer would pick (`full_weight_transport`):
                   pause / transfer / resume seconds and bytes, after one unreported warm-up sync

The embedded server runs twice: without LoRA (base generation and merged sync, what a run without
adapter serving does) and with --enable-lora (base vs adapter generation, adapter sync; on CUDA its
steps replay graphs with the adapters' deltas). vLLM runs as it was started: the adapter phases need
--enable-lora --max-lora-rank 32 --max-loras 4 and VLLM_ALLOW_RUNTIME_LORA_UPDATING=1, the merged one a
--weight-transfer-config (`ipc` when vLLM shares this process's GPU, with
VLLM_ALLOW_INSECURE_SERIALIZATION=1); a phase it cannot run is recorded with the reason. The merged
phase ends by pushing the base weights back, so vLLM serves the model it was started with again.

Before each sync the adapter moves (seeded), as a training step moves it. A phase starts no new sync or
wave once `--phase-timeout-s` has passed, and every server call is bounded by the same time. The JSON
is rewritten after every phase and on SIGTERM; `status` is "complete" only when every phase ran in
full. A phase that raised is recorded with its error and the script exits 1 after the others ran.

    python bench/lora_sync.py --shape tiny                                    # CPU, ~1-2 min
    python bench/serve_throughput.py --random-qwen3 1.7b --model-dir /tmp/qwen3-1.7b --build-only
    python bench/lora_sync.py --shape 1.7b --device cuda --model-dir /tmp/qwen3-1.7b [--vllm-url URL]

vLLM must serve the same `--model-dir`. Writes bench/results/lora_sync_<device>.json (`--output`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast stays off on shared GPUs

import torch
from provenance import command_line
from random_qwen3 import SHAPES, build_random_qwen3
from serve_throughput import device_slug, make_prompts, wait_for_health

from asyncgrpo.types import WeightVersion

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
MAX_STALENESS = 1  # two adapter versions stay registered, as in a run with max_staleness=1
SIZES = {  # requests, syncs and time per shape (each can be overridden on the command line)
    "tiny": {
        "concurrency": 4,
        "prompt_len": 16,
        "max_tokens": 16,
        "syncs": 3,
        "reps": 2,
        "phase_timeout_s": 120,
    },
    "1.7b": {
        "concurrency": 64,
        "prompt_len": 128,
        "max_tokens": 256,
        "syncs": 5,
        "reps": 3,
        "phase_timeout_s": 240,
    },
}


class Report:
    """The results, rewritten to `path` after every phase; `phase` bounds and records one phase."""

    def __init__(self, path: Path, data: dict) -> None:
        self.path = path
        self.data = {**data, "status": "running"}
        self.failed: list[str] = []
        self.cut: list[str] = []
        self.current = "start-up"  # the phase running now (named in the status of an interrupted run)

    def write(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps(self.data, indent=2) + "\n")

    def phase(self, server: str, name: str, run: Callable[[float], dict], timeout_s: float) -> dict:
        """`run(deadline)` starts no new iteration after `deadline` (time.monotonic()) and says so with
        "timed_out": True. An exception is recorded as the phase's "error" (the script then exits 1)."""
        print(f"[{server}] {name} (at most {timeout_s:.0f} s)", flush=True)
        self.current = f"{server}/{name}"
        t0 = time.monotonic()
        try:
            result = run(t0 + timeout_s)
        except Exception as exc:  # noqa: BLE001 -- recorded in the JSON and turned into exit code 1 in main()
            result = {"error": f"{type(exc).__name__}: {exc}"}
            self.failed.append(f"{server}/{name}")
            print(f"[{server}] {name} FAILED: {result['error']}", flush=True)
        if result.get("timed_out"):
            self.cut.append(f"{server}/{name}")
        result["phase_s"] = time.monotonic() - t0
        self.data.setdefault(server, {})[name] = result
        self.write()
        return result

    def finish(self, interrupted: BaseException | None = None) -> None:
        problems = [f"interrupted ({type(interrupted).__name__}) in {self.current}"] if interrupted else []
        problems += [f"failed: {', '.join(self.failed)}"] if self.failed else []
        problems += [f"cut by --phase-timeout-s: {', '.join(self.cut)}"] if self.cut else []
        self.data["status"] = "; ".join(problems) or "complete"
        self.write()
        self.current = "the end"


# -- the trainer's model and adapter ----------------------------------------------------------------


def peft_model(path: str, dtype: torch.dtype, device: str, rank: int) -> torch.nn.Module:
    """The base checkpoint with a LoRA of `rank` on every attention and MLP projection, its A and B
    both random (a trained adapter, not PEFT's zero-B start, so that serving it changes the output)."""
    import peft
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    config = peft.LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=TARGETS, init_lora_weights=False)
    return peft.get_peft_model(model, config)


def move_adapter(model: torch.nn.Module, seed: int) -> None:
    """A training step's worth of change to the adapter (B moves by 1% of its spread)."""
    g = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                noise = torch.randn(p.shape, generator=g, device=p.device, dtype=torch.float32)
                p.add_((noise * p.float().std() * 0.01).to(p.dtype))


@contextlib.contextmanager
def adapter_off(model: torch.nn.Module):
    """lora_B zeroed for the duration: the merged weights are then exactly the base weights."""
    saved = {n: p.detach().clone() for n, p in model.named_parameters() if "lora_B" in n}
    params = dict(model.named_parameters())
    with torch.no_grad():
        for n in saved:
            params[n].zero_()
    try:
        yield
    finally:
        with torch.no_grad():
            for n, value in saved.items():
                params[n].copy_(value)


def adapter_numel(model: torch.nn.Module) -> int:
    return sum(p.numel() for n, p in model.named_parameters() if "lora_" in n)


# -- phases ------------------------------------------------------------------------------------------


def summarize(runs: list[dict], keys: tuple[str, ...]) -> dict:
    return {"median": {k: statistics.median(r[k] for r in runs) for k in keys}, "bytes": runs[0]["bytes"]}


async def wave(url: str, model: str | None, prompts: list[list[int]], max_tokens: int, seed0: int,
               timeout_s: float) -> tuple[float, list[list[int]]]:
    """All prompts at once through the trainer's client: (generated tokens/s, each request's tokens)."""
    from asyncgrpo.generation.client import GenerationClient
    from asyncgrpo.generation.protocol import SamplingParams

    async with GenerationClient(url, timeout_s=timeout_s) as client:
        await client.detect()
        t0 = time.perf_counter()
        outs = await asyncio.gather(
            *(
                client.generate(
                    p,
                    SamplingParams(
                        temperature=1.0,
                        top_k=20,
                        max_tokens=max_tokens,
                        ignore_eos=True,
                        seed=seed0 + i,
                        logprobs=0,
                    ),
                    model=model,
                )
                for i, p in enumerate(prompts)
            )
        )
        elapsed = time.perf_counter() - t0
    tokens = [o.token_ids for o in outs]
    return sum(map(len, tokens)) / elapsed, tokens


def generation_phase(url: str, adapter: str | None, prompts, args, deadline: float) -> dict:
    """Base (and adapter) waves on the same requests, alternating; see the module docstring."""
    modes = {"base": None, **({"adapter": adapter} if adapter else {})}
    budget = max(1.0, deadline - time.monotonic())
    warm = [p[::-1] for p in prompts]  # one-time costs, and nothing of the timed prompts cached
    for name in modes.values():
        asyncio.run(wave(url, name, warm, 4, 10_000, budget))
    rates: dict[str, list[float]] = {m: [] for m in modes}
    outputs: dict[str, list[list[int]]] = {}
    timed_out = False
    for rep in range(args.reps):
        if time.monotonic() > deadline:
            timed_out = True
            break
        for mode, name in modes.items():
            rate, outputs[mode] = asyncio.run(wave(url, name, prompts, args.max_tokens, 0, budget))
            rates[mode].append(rate)
            print(f"  {mode:<8} rep {rep}: {rate:10.1f} generated tokens/s", flush=True)
    result: dict = {m: {"tokens_per_s": statistics.median(r), "runs": r} for m, r in rates.items() if r}
    result.update(num_requests=len(prompts), max_tokens=args.max_tokens, prompt_len=args.prompt_len,
                  timed_out=timed_out)
    if "adapter" in result and "base" in result:
        result["slowdown"] = result["base"]["tokens_per_s"] / result["adapter"]["tokens_per_s"]
        result["identical_outputs"] = sum(
            a == b for a, b in zip(outputs["base"], outputs["adapter"], strict=True)
        )
        if result["identical_outputs"] > len(prompts) // 2:
            print(f"  WARNING: {result['identical_outputs']}/{len(prompts)} requests gave the base model's "
                  "tokens "
                  "under the adapter: is the adapter applied?", flush=True)
        print(f"  slowdown base / adapter: {result['slowdown']:.3f}x", flush=True)
    return result


def adapter_sync_phase(sync, model, dtype: torch.dtype, args, deadline: float) -> dict:
    """Versions 1.. (version 0 was the first load); the adapter moves before each."""
    runs, timed_out = [], False
    for i in range(args.syncs):
        if time.monotonic() > deadline:
            timed_out = True
            break
        move_adapter(model, seed=100 + i)
        runs.append(sync.push(model, WeightVersion(1 + i)))
        r = runs[-1]
        print(f"  adapter sync {i}: write {r['write_s']:.3f} s, load {r['load_s']:.3f} s, total "
              f"{r['total_s']:.3f} s, "
              f"{r['bytes'] / 1e6:.1f} MB", flush=True)
    if not runs:
        return {"timed_out": True}
    return {**summarize(runs, ("write_s", "load_s", "total_s")), "syncs": runs, "timed_out": timed_out}


def merged_sync_phase(url: str, model, dtype: torch.dtype, args, deadline: float, restore_base: bool) -> dict:
    """One warm-up and `--syncs` reported merged pushes; with `restore_base` a last push of the base
    weights (lora_B zeroed), so the server serves what it was started with."""
    from asyncgrpo.train.server_link import ServerLink
    from asyncgrpo.train.weights.choose import full_weight_transport

    link = ServerLink(url, timeout_s=max(30.0, deadline - time.monotonic()))
    try:
        info = link.connect()
        try:
            transport = full_weight_transport(link, torch.device(args.device), dtype, info.device)
        except ValueError as exc:  # this server takes no weights from this trainer: say why, not a failure
            return {"skipped": str(exc)}
        transport.init()
        runs, timed_out = [], False
        try:
            for i in range(args.syncs + 1):
                if time.monotonic() > deadline:
                    timed_out = True
                    break
                move_adapter(model, seed=200 + i)
                if model.device.type == "cuda":
                    torch.cuda.synchronize(model.device)
                r = transport.push(model, WeightVersion(1 + i))
                print(
                    f"  merged sync {i}{' (warm-up)' if i == 0 else ''}: pause {r['pause_s']:.3f} s, "
                    "transfer "
                    f"{r['transfer_s']:.3f} s, total {r['total_s']:.3f} s, {r['bytes'] / 1e6:.1f} MB",
                    flush=True,
                )
                if i:
                    runs.append(r)
            if restore_base:
                with adapter_off(model):
                    transport.push(model, WeightVersion(0))  # the weights the server started with
                print("  base weights pushed back", flush=True)
        finally:
            transport.close()
    finally:
        link.close()
    if not runs:
        return {"timed_out": True}
    backend = getattr(transport, "backend", None) or f"ipc ({transport.sender.dialect})"
    return {**summarize(runs, ("pause_s", "transfer_s", "resume_s", "total_s")), "transport": backend,
            "syncs": runs, "timed_out": timed_out}


def lora_phases(report: Report, label: str, url: str, model, dtype, prompts, args, workdir: Path) -> None:
    """Against a server serving LoRA adapters at run time: first load, generation, adapter syncs."""
    from asyncgrpo.train.weights.adapters import AdapterSync

    sync = AdapterSync(
        url,
        output_dir=workdir / label,
        max_staleness=MAX_STALENESS,
        timeout_s=args.phase_timeout_s,
        dtype=dtype,
        name="bench-lora",
    )
    sync.init()
    try:
        report.phase(label, "first_load", lambda deadline: sync.push(model, WeightVersion(0)),
                     args.phase_timeout_s)
        report.phase(label, "generation",
                     lambda deadline: generation_phase(url, sync.adapter_name(0), prompts, args, deadline),
                     args.phase_timeout_s)
        report.phase(
            label,
            "adapter_sync",
            lambda deadline: adapter_sync_phase(sync, model, dtype, args, deadline),
            args.phase_timeout_s,
        )
    finally:
        sync.close()


def detect(url: str, timeout_s: float):
    """What the trainer learns about the server at start (`ServerInfo`: version, LoRA serving, ...)."""
    from asyncgrpo.generation.client import GenerationClient

    async def run():
        async with GenerationClient(url, timeout_s=timeout_s) as client:
            return await client.detect()

    return asyncio.run(run())


def ratios(side: dict) -> dict:
    """Merged over adapter-only: bytes and median total seconds of one sync (when both ran)."""
    merged, adapter = side.get("merged_sync", {}), side.get("adapter_sync", {})
    if "median" not in merged or "median" not in adapter:
        return {}
    return {"bytes_merged_over_adapter": merged["bytes"] / adapter["bytes"],
            "seconds_merged_over_adapter": merged["median"]["total_s"] / adapter["median"]["total_s"]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", choices=sorted(SIZES), default="tiny", help="Random Qwen3 shape.")
    p.add_argument(
        "--model-dir", default=None, help="Where to write/reuse the random model (default: a temp dir)."
    )
    p.add_argument("--device", default="cpu", help="cpu or cuda: the trainer and the embedded server.")
    p.add_argument(
        "--rank", type=int, default=32, help="LoRA r (the embedded server gets it as --max-lora-rank)."
    )
    p.add_argument(
        "--vllm-url", default=None, help="Also measure this running vLLM 0.33 (serving --model-dir)."
    )
    p.add_argument("--vllm-wait-s", type=float, default=600, help="How long to wait for vLLM's /health.")
    p.add_argument("--skip-embedded", action="store_true", help="Measure vLLM only.")
    for name in ("concurrency", "prompt_len", "max_tokens", "syncs", "reps"):
        p.add_argument(f"--{name.replace('_', '-')}", type=int, default=None, help="Default: per --shape.")
    p.add_argument("--phase-timeout-s", type=float, default=None, help="Default: per --shape.")
    p.add_argument("--output", default=None)
    args = p.parse_args(argv)
    for key, value in SIZES[args.shape].items():
        if getattr(args, key) is None:
            setattr(args, key, value)

    tmp = tempfile.TemporaryDirectory()
    workdir = Path(tmp.name)
    path = Path(args.model_dir or workdir / "model")
    if not (path / "config.json").exists():
        print(f"building a random Qwen3-{args.shape} in {path}", flush=True)
        build_random_qwen3(args.shape, path)
    out = Path(
        args.output or Path(__file__).parent / "results" / f"lora_sync_{device_slug(args.device)}.json"
    )
    report = Report(out, {
        "command": command_line(argv),
        "meta": {"shape": args.shape, "shape_config": SHAPES[args.shape], "lora_rank": args.rank,
                 "lora_targets": TARGETS, "max_staleness": MAX_STALENESS, "device": device_slug(args.device),
                 "torch": torch.__version__, "platform": platform.platform(),
                 "args": {k: v for k, v in vars(args).items()}},
    })
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # -> the finally below writes what there is
    try:
        dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
        serve = ["--dtype", str(dtype).removeprefix("torch."),
                 "--max-model-len", str(args.prompt_len + args.max_tokens + 16),
                 "--max-num-seqs", str(args.concurrency),
                 "--kv-cache-tokens", str(args.concurrency * (args.prompt_len + args.max_tokens + 16))]
        model = peft_model(str(path), dtype, args.device, args.rank)
        report.data["meta"].update(dtype=str(dtype).removeprefix("torch."),
                                   params=sum(p.numel() for p in model.parameters()) - adapter_numel(model),
                                   adapter_params=adapter_numel(model))
        report.write()
        vocab = model.config.vocab_size
        prompts = make_prompts(args.concurrency, args.prompt_len, vocab)
        if not args.skip_embedded:
            from asyncgrpo.launch import EmbeddedServer

            log = workdir / "server.log"
            print(f"embedded server without LoRA on {args.device} (log: {log})", flush=True)
            with EmbeddedServer(str(path), device=args.device, extra_args=serve, log_path=log,
                                startup_timeout_s=600) as server:
                report.phase("embedded", "generation_without_lora",
                             lambda deadline: generation_phase(server.url, None, prompts, args, deadline),
                             args.phase_timeout_s)
                report.phase(
                    "embedded",
                    "merged_sync",
                    lambda deadline: merged_sync_phase(server.url, model, dtype, args, deadline, False),
                    args.phase_timeout_s,
                )
            lora_args = [
                "--enable-lora",
                "--max-lora-rank",
                str(args.rank),
                "--max-loras",
                str(MAX_STALENESS + 2),
            ]
            print(f"embedded server with {' '.join(lora_args)}", flush=True)
            with EmbeddedServer(str(path), device=args.device, extra_args=[*serve, *lora_args], log_path=log,
                                startup_timeout_s=600) as server:
                lora_phases(report, "embedded", server.url, model, dtype, prompts, args, workdir)
            report.data["embedded"].update(ratios(report.data["embedded"]))
        if args.vllm_url:
            wait_for_health(args.vllm_url, args.vllm_wait_s)
            info = detect(args.vllm_url, args.phase_timeout_s)
            lora = info.lora
            report.data["vllm"] = {"url": args.vllm_url, "version": info.version, "model": info.model_name,
                                   "lora": None if lora is None else vars(lora).copy()}
            print(f"vLLM {info.version} at {args.vllm_url}", flush=True)
            if lora is not None and lora.runtime_updating:
                lora_phases(report, "vllm", args.vllm_url, model, dtype, prompts, args, workdir)
            else:
                report.data["vllm"]["adapter_phases"] = (
                    "skipped: start vLLM with --enable-lora --max-lora-rank 32 --max-loras 4 and "
                    "VLLM_ALLOW_RUNTIME_LORA_UPDATING=1")
                report.phase("vllm", "generation",
                             lambda deadline: generation_phase(args.vllm_url, None, prompts, args, deadline),
                             args.phase_timeout_s)
            report.phase(
                "vllm",
                "merged_sync",
                lambda deadline: merged_sync_phase(args.vllm_url, model, dtype, args, deadline, True),
                args.phase_timeout_s,
            )
            report.data["vllm"].update(ratios(report.data["vllm"]))
    except BaseException as exc:
        report.finish(interrupted=exc)
        raise
    else:
        report.finish()
    finally:
        tmp.cleanup()
    print_summary(report.data)
    print(f"wrote {out} ({report.data['status']})")
    return 1 if report.failed else 0


def print_summary(data: dict) -> None:
    for side in ("embedded", "vllm"):
        if side not in data:
            continue
        d = data[side]
        gen = d.get("generation", {})
        plain = d.get("generation_without_lora", {}).get("base", {}).get("tokens_per_s")
        print(f"{side}:")
        if "slowdown" in gen:
            line = (f"  generation: base {gen['base']['tokens_per_s']:.1f} tok/s, adapter "
                    f"{gen['adapter']['tokens_per_s']:.1f} tok/s, slowdown {gen['slowdown']:.3f}x")
            if plain:
                line += (
                    f" (server without LoRA {plain:.1f} tok/s, {plain / gen['adapter']['tokens_per_s']:.3f}x)"
                )
            print(line)
        for name in ("adapter_sync", "merged_sync"):
            s = d.get(name, {})
            if "median" in s:
                print(f"  {name}: {s['median']['total_s']:.3f} s, {s['bytes'] / 1e6:.1f} MB")
            elif s:
                print(f"  {name}: {s.get('skipped') or s.get('error') or 'no sync finished'}")
        if "bytes_merged_over_adapter" in d:
            print(f"  merged / adapter: {d['bytes_merged_over_adapter']:.1f}x bytes, "
                  f"{d['seconds_merged_over_adapter']:.1f}x seconds")


if __name__ == "__main__":
    raise SystemExit(main())
