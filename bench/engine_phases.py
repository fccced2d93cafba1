"""Where the embedded server's engine spends a workload's time, step by step (no HTTP).

The server's own scheduler (prefix caching, chunked prefill), model runner and decode graphs run
one of the request shapes of bench/serve_throughput.py in this process:

    group      C / G prompts of `--prompt-len` tokens, each sent G times (`--group-size`), all at once
    turns      C conversations of `--turns` turns: a turn enters `--turn-gap-steps` steps (plus a random
               0 .. `--turn-gap-jitter`, as HTTP round trips spread them) after the previous one
               finished, with its prompt + completion + `--turn-tokens` new tokens
    distinct   C different prompts (group size 1)

Every step is put in one class, and each class gets its count and per-step times:

    decode     decode-only step (CUDA: graph replay)
    mixed      decode tokens and prompt chunks in one forward (a graph replay where the chunks are
               short, `step_rows.prompt_rows`; else eager)
    prefill    prompt chunks only (likewise)

    schedule   host: the scheduler's plan
    launch     host: ModelRunner.launch (inputs, Python, kernel launches)
    wait       host: waiting for the step's output to reach the host (LaunchedStep.result)
    device     CUDA events around the step (device time from its first launch to its output)
    record     host: appending the step's tokens, releasing finished sequences

With `--scheduling async` (the server's default on CUDA) a step is launched before the previous one
is recorded, as the engine does: its `wait` and `record` are the previous step's, and a step whose
`wait` is still near zero is host-bound even with the host's work overlapped.

`--prompt-attention flash_varlen,padded` (the values of `asyncgrpo serve --prompt-attention`) compares
the two layouts of prompt chunks (`server/attention/varlen.py`:
one FlashAttention call per layer, against chunks padded into a batch) in one run.

A step whose `wait` is near zero is host-bound (the device idles while Python launches); one whose
`launch` is small against `device` is device-bound. `--profile` also runs the torch profiler over one
step of each class and reports its number of device kernels (CPU: operators) and its device time by
kernel category (attention, matmul, sampling, other), then cProfile over the next step of the class:
the Python functions with the most own time (`host_functions`), which is where a host-bound step goes.

    python bench/engine_phases.py --random-qwen3 0.6b --device cuda --shape group --concurrency 256 \\
        --prompt-len 2048 --group-size 8 --max-tokens 256 --profile
    python bench/engine_phases.py --random-qwen3 0.6b --device cuda --shape turns --concurrency 64 \\
        --prompt-len 512 --max-tokens 128 --turns 4 --turn-tokens 64 --profile
    python bench/engine_phases.py --random-qwen3 tiny --device cpu --shape group --concurrency 256 \\
        --prompt-len 256 --group-size 8 --max-tokens 16          # host overhead per step on CPU

Each configuration runs twice over one KV cache and one set of step graphs, as a server serves two
waves of requests: the first run captures the graphs and compiles the kernels, the second is reported
(with the graphs it still had to capture: shapes the first run did not meet). `--shared-prefix off` serves
decode attention without reading a group's shared prompt once for all its members
(`server/attention/shared_prefix.py`), for a side-by-side. Writes
bench/results/engine_phases_<shape>_<device>.json.
"""

from __future__ import annotations

import argparse
import collections
import os
import platform
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parent))
from provenance import command_line, package_versions
from serve_throughput import SHAPES, device_slug, make_prompts, prepare_model, write_results

from asyncgrpo.server.attention.base import PlanFlags
from asyncgrpo.server.attention.plan import ExecutionPlan, resolve_plan
from asyncgrpo.server.kv_cache import PagedKVCache
from asyncgrpo.server.loading import load_served_model, resolve_device
from asyncgrpo.server.prefix_cache import BlockPool
from asyncgrpo.server.runner import ModelRunner
from asyncgrpo.server.scheduler import Scheduler
from asyncgrpo.server.sequence import SeqParams, Sequence
from asyncgrpo.server.step_graphs import MAX_PROMPT_ROWS, StepGraphs

BLOCK_SIZE = 16
PHASES = ("schedule", "launch", "wait", "device", "record")
KERNEL_CATEGORIES = (  # first match wins (lower-case kernel names)
    ("attention", ("paged_decode", "merge_splits", "shared_prefix", "flash", "fmha", "attention", "sdpa")),
    ("matmul", ("gemm", "cutlass", "nvjet", "xmma", "sm90", "matmul", "aten::mm", "aten::addmm",
                "aten::bmm")),
    ("sampling", ("sort", "topk", "cumsum", "softmax", "argmax", "exponential", "scan", "radix")),
)


def kernel_category(name: str) -> str:
    low = name.lower()
    for category, keys in KERNEL_CATEGORIES:
        if any(k in low for k in keys):
            return category
    return "other"


class StepTimer:
    """Host and device times of a step: `ModelRunner.launch` (host), then `LaunchedStep.result` (the wait
    for the device), and CUDA events around it."""

    def __init__(self, runner: ModelRunner) -> None:
        self.cuda = runner.device.type == "cuda"
        self.launch = self.wait = 0.0
        self._events = None

    def step(self, runner: ModelRunner, decode, prefill):
        if self.cuda:
            self._events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            self._events[0].record()
        t = time.perf_counter()
        launched = runner.launch(decode, prefill)
        if self.cuda:
            self._events[1].record()
        t2 = time.perf_counter()
        self.launch = t2 - t
        out = launched.result()
        self.wait = time.perf_counter() - t2
        return out

    def device_s(self) -> float:
        """Device span of the last step (0 without CUDA)."""
        if not self.cuda or self._events is None:
            return 0.0
        self._events[1].synchronize()
        return self._events[0].elapsed_time(self._events[1]) / 1e3


def step_class(plan) -> str:
    if not plan.prefill:
        return "decode"
    return "mixed" if plan.decode else "prefill"


class Workload:
    """The sequences of one shape, entering the scheduler as the shape says."""

    def __init__(self, args, vocab: int, seed: int) -> None:
        self.args = args
        group = args.group_size if args.shape == "group" else 1
        self.prompts = make_prompts(args.concurrency, args.prompt_len, vocab, seed=seed, group_size=group)
        self.extras = [make_prompts(max(args.turns - 1, 1), args.turn_tokens, vocab, seed=seed + 7 + i)
                       for i in range(args.concurrency)]
        self.turns = args.turns if args.shape == "turns" else 1
        self.params = SeqParams(
            temperature=1.0, top_k=args.top_k, top_p=1.0, min_p=0.0, seed=0, max_tokens=args.max_tokens,
            min_tokens=0, stop_token_ids=frozenset(), eos_token_id=None, extra_eos_ids=frozenset(),
            logprobs=args.logprobs or None, want_mask=False,
        )
        self.pending: list[tuple[int, Sequence]] = []  # (step at which it enters, sequence)
        self.rng = np.random.default_rng(seed)
        self.num_ids = 0
        self.done: list[Sequence] = []

    def _new(self, conv: int, turn: int, prompt: list[int], max_len: int) -> Sequence:
        self.num_ids += 1
        seq = Sequence(self.num_ids, f"c{conv}", 0, prompt, self.params, max_model_len=max_len)
        seq.sink = (conv, turn)
        return seq

    def start(self, max_len: int) -> list[Sequence]:
        return [self._new(i, 0, list(p), max_len) for i, p in enumerate(self.prompts)]

    def finished(self, seq: Sequence, step: int, max_len: int) -> None:
        """seq ended at `step`: its conversation's next turn enters turn_gap_steps later."""
        self.done.append(seq)
        conv, turn = seq.sink
        if turn + 1 < self.turns:
            prompt = seq.prompt + seq.output + self.extras[conv][turn]
            gap = self.args.turn_gap_steps + int(self.rng.integers(0, self.args.turn_gap_jitter + 1))
            self.pending.append((step + 1 + gap, self._new(conv, turn + 1, prompt, max_len)))

    def due(self, step: int) -> list[Sequence]:
        ready = [s for at, s in self.pending if at <= step]
        self.pending = [(at, s) for at, s in self.pending if at > step]
        return ready


def max_len_of(args) -> int:
    return args.prompt_len + args.turns * (args.max_tokens + args.turn_tokens) + 16


def engine_state(served, args, flags: PlanFlags) -> tuple[PagedKVCache, ExecutionPlan, StepGraphs | None]:
    """The KV cache, the execution plan (resolved with `flags`) and the step graphs, kept from one run to the
    next (the graphs replay on the cache's tensors), as a server keeps them from one wave of requests to the
    next."""
    max_len = max_len_of(args)
    # room for every sequence at full length, or with caching for each distinct prompt once
    num_tokens = args.concurrency * max_len
    if args.caching == "on" and args.shape == "group":
        num_tokens = -(-args.concurrency // args.group_size) * args.prompt_len + args.concurrency * (
            max_len - args.prompt_len + 2 * BLOCK_SIZE)
    num_blocks = num_tokens // BLOCK_SIZE + 64
    cache = PagedKVCache(served.num_layers, num_blocks, BLOCK_SIZE, served.num_kv_heads, served.head_dim,
                         served.dtype, served.device, served.attention_layers)
    plan = resolve_plan(served.model, cache, served.device, flags)
    graphs = (StepGraphs(served.model, cache, plan, args.concurrency, -(-max_len // BLOCK_SIZE),
                         served.device.type == "cuda", served.vocab_size, args.max_prompt_rows)
              if args.graphs == "on" else None)
    return cache, plan, graphs


def run_workload(served, args, seed: int, profile: bool,
                 state: tuple[PagedKVCache, ExecutionPlan, StepGraphs | None],
                 asynchronous: bool = False) -> dict:
    """One run of the workload through a fresh scheduler and model runner over `state` (`engine_state`: the
    plan decides the shared-prefix pass and the prompt layout); per-class step times. asynchronous: each
    step is launched before the previous one is recorded (`wait` and `record` are the previous step's,
    `device` is not measured, no profile)."""
    max_len = max_len_of(args)
    cache, plan, graphs = state
    captures_before = 0 if graphs is None else graphs.num_captures
    scheduler = Scheduler(BlockPool(cache.num_blocks, args.caching == "on"), BLOCK_SIZE, args.concurrency,
                          args.max_num_batched_tokens, max_len, admission_interval=args.admission_interval)
    assert graphs is None or graphs.max_blocks == scheduler.max_blocks
    cuda = served.device.type == "cuda"
    runner = ModelRunner(served.model, cache, plan, served.vocab_size, scheduler.block_table, graphs)
    timer = StepTimer(runner)
    work = Workload(args, served.vocab_size, seed)
    for s in work.start(max_len):
        scheduler.add(s)
    steps: dict[str, dict[str, list[float]]] = collections.defaultdict(lambda: collections.defaultdict(list))
    profiles: dict[str, dict] = {}
    tokens = {"prefilled": 0, "generated": 0}
    step = 0
    in_flight = None  # asynchronous: (launched step, its sampled sequences, its step number)

    def finish(launched, sampled, at: int) -> float:
        """Record a launched step's tokens (the engine's `_finish`); returns the wait for the device."""
        t = time.perf_counter()
        out = launched.result()
        waited = time.perf_counter() - t
        for s in out.record(sampled, "v"):
            if s.finished:
                scheduler.remove(s)
                work.finished(s, at, max_len)
            else:
                scheduler.recorded(s)
        return waited

    start = time.perf_counter()
    while scheduler.has_work() or work.pending or in_flight:
        for s in work.due(step):
            scheduler.add(s)
        t0 = time.perf_counter()
        plan = scheduler.schedule()
        t1 = time.perf_counter()
        kind = step_class(plan)
        if plan.size == 0:
            if in_flight:
                finish(*in_flight)
                in_flight = None
            step += 1
            continue
        if asynchronous:  # the engine's loop with --async-scheduling: launch, then record the previous step
            launched = runner.launch(plan.decode, plan.prefill)
            t2 = time.perf_counter()
            waited = finish(*in_flight) if in_flight else 0.0
            in_flight = (launched, plan.sampled, step)
            t3 = time.perf_counter()
            tokens["prefilled"] += sum(s.prefill_end - s.prefill_start for s in plan.prefill)
            tokens["generated"] += len(plan.sampled)
            rec = steps[kind]
            for name, value in zip(PHASES, (t1 - t0, t2 - t1, waited, 0.0, t3 - t2 - waited)):
                rec[name].append(value)
            rec["wall"].append(t3 - t0)
            rec["batch"].append(plan.size)
            step += 1
            continue
        if profile and kind not in profiles and step > 2:
            profiles[kind], out = profile_step(runner.step, plan.decode, plan.prefill, cuda=cuda)
            timer.launch = timer.wait = 0.0
        elif profile and kind in profiles and "host_functions" not in profiles[kind]:
            profiles[kind]["host_functions"], out = profile_host(runner.step, plan.decode, plan.prefill)
            timer.launch = timer.wait = 0.0
        else:
            out = timer.step(runner, plan.decode, plan.prefill)
        t2 = time.perf_counter()
        out.record(plan.sampled, "v")
        for s in plan.sampled:
            if s.finished:
                scheduler.remove(s)
                work.finished(s, step, max_len)
        t3 = time.perf_counter()
        tokens["prefilled"] += sum(s.prefill_end - s.prefill_start for s in plan.prefill)
        tokens["generated"] += len(plan.sampled)
        rec = steps[kind]
        for name, value in zip(PHASES, (t1 - t0, timer.launch, timer.wait, timer.device_s(), t3 - t2)):
            rec[name].append(value)
        rec["wall"].append(t3 - t0)
        rec["batch"].append(plan.size)
        step += 1
    wall = time.perf_counter() - start
    summary = {}
    for kind, rec in steps.items():
        summary[kind] = {
            "steps": len(rec["wall"]),
            "total_s": sum(rec["wall"]),
            "median_batch": statistics.median(rec["batch"]),
            "median_ms": {k: 1e3 * statistics.median(rec[k]) for k in (*PHASES, "wall")},
            "total_phase_s": {k: sum(rec[k]) for k in PHASES},
        }
    return {"seconds": wall, "tokens": tokens, "generated_tokens_per_s": tokens["generated"] / wall,
            "steps": summary, "profiles": profiles,
            "graph_captures": 0 if graphs is None else graphs.num_captures - captures_before,
            "prefix_hit_frac": scheduler.pool.stats.hits / max(scheduler.pool.stats.queries, 1)}


def profile_step(step, decode, prefill, cuda: bool) -> tuple[dict, object]:
    """Run step(decode, prefill) (ModelRunner.step) under the torch profiler: its kernel count and
    device time by category."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        out = step(decode, prefill)
    by_category: dict[str, float] = collections.defaultdict(float)
    num_kernels = num_ops = 0
    for e in prof.events():
        if cuda and e.device_type.name == "CUDA":
            num_kernels += 1
            by_category[kernel_category(e.name)] += e.device_time / 1e3
        elif not cuda and e.name.startswith("aten::") and e.cpu_parent is None:
            num_ops += 1
    result = {"device_kernels": num_kernels} if cuda else {"top_level_aten_ops": num_ops}
    if cuda:
        result["device_ms_by_category"] = dict(by_category)
    return result, out


def profile_host(step, decode, prefill, top: int = 20) -> tuple[list[dict], object]:
    """Run step(decode, prefill) under cProfile: the Python functions with the most own time (the
    host's share of a step that the device waits for), with their call counts."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    out = step(decode, prefill)
    prof.disable()
    # (file, line, name) -> (primitive calls, calls, own s, cumulative s, callers)
    stats = pstats.Stats(prof).stats
    rows = sorted(stats.items(), key=lambda kv: kv[1][2], reverse=True)[:top]
    return [{"function": f"{Path(f).name}:{line}:{name}", "calls": calls, "own_ms": 1e3 * own,
             "cum_ms": 1e3 * cum}
            for (f, line, name), (_, calls, own, cum, _) in rows], out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="asyncgrpo/tiny-chat")
    p.add_argument("--random-qwen3", choices=sorted(SHAPES), default=None)
    p.add_argument("--model-dir", default=None)
    p.add_argument("--device", default="cuda")
    p.add_argument("--shape", choices=("group", "turns", "distinct"), default="group")
    p.add_argument("--concurrency", type=int, default=256)
    p.add_argument("--prompt-len", type=int, default=2048)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--turn-tokens", type=int, default=64)
    p.add_argument("--turn-gap-steps", type=int, default=1,
                   help="Steps between a turn's end and the next turn.")
    p.add_argument("--turn-gap-jitter", type=int, default=8,
                   help="Up to this many more steps, drawn per turn.")
    p.add_argument("--top-k", type=int, default=20)
    p.add_argument("--logprobs", type=int, default=0)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--caching", choices=("on", "off"), default="on")
    p.add_argument("--admission-interval", type=int, default=1,
                   help="As `asyncgrpo serve --admission-interval`.")
    p.add_argument("--graphs", choices=("on", "off"), default="on", help="CUDA graphs for decode-only steps.")
    p.add_argument("--max-prompt-rows", type=int, default=MAX_PROMPT_ROWS,
                   help="Prompt tokens a step may add to its decode rows and still replay a graph (the "
                   f"server's {MAX_PROMPT_ROWS}); longer steps run eagerly.")
    p.add_argument("--shared-prefix", default="on,off",
                   help="Comma-separated: decode attention reads a group's shared prompt once (on) or per "
                   "sequence (off).")
    p.add_argument("--scheduling", default="sync,async",
                   help="Comma-separated: each step recorded before the next is planned (sync), or the next "
                   "launched first, as `asyncgrpo serve --async-scheduling` (async).")
    p.add_argument("--prompt-attention", default="auto",
                   help="Comma-separated, as `asyncgrpo serve --prompt-attention`: prompt chunks packed for "
                   "FlashAttention's variable-length kernel (flash_varlen), padded into a batch (padded), or "
                   "the server's choice (auto).")
    p.add_argument("--profile", action="store_true")
    p.add_argument("--output", default=None)
    args = p.parse_args()
    layouts = {"auto": None, "flash_varlen": True, "padded": False}  # -> PlanFlags(packed_prompts=...)
    unknown = set(args.prompt_attention.split(",")) - set(layouts)
    if unknown:
        p.error(f"--prompt-attention {args.prompt_attention}: unknown {sorted(unknown)}; give auto, "
                "flash_varlen or padded")
    if args.shape != "turns":
        args.turns = 1
    model, tmp = prepare_model(args)
    device = resolve_device(args.device)
    served = load_served_model(model, device, "auto", None)
    results: dict = {"config": vars(args),
                     "host": {"platform": platform.platform(), "torch": torch.__version__,
                              "device_name": device_slug(args.device)},
                     "command": command_line(), "versions": package_versions(), "runs": {}}
    modes = [(shared, sched, layout) for shared in args.shared_prefix.split(",")
             for sched in args.scheduling.split(",") for layout in args.prompt_attention.split(",")]
    for mode, scheduling, layout in modes:
        shared, asynchronous, varlen = mode == "on", scheduling == "async", layouts[layout]
        # the first run captures the graphs and builds the kernels; the second replays them
        state = engine_state(served, args, PlanFlags(shared_prefix=shared, packed_prompts=varlen))
        first = run_workload(served, args, seed=1, profile=False, state=state, asynchronous=asynchronous)
        r = run_workload(served, args, seed=0, profile=args.profile and not asynchronous, state=state,
                         asynchronous=asynchronous)
        r["first_run"] = {k: first[k] for k in ("seconds", "generated_tokens_per_s", "graph_captures")}
        key = (f"shared_prefix_{mode}" + ("_async" if asynchronous else "")
               + ("" if layout == "auto" else f"_{layout}"))
        results["runs"][key] = r
        print(f"[{layout} prompts] ", end="")
        print(f"shared prefix {mode}, {scheduling}: {r['generated_tokens_per_s']:.0f} generated tok/s in "
              f"{r['seconds']:.2f} s (prefix hits {r['prefix_hit_frac']:.2f}; {r['graph_captures']} graphs "
              f"captured, {first['graph_captures']} in the first run at "
              f"{first['generated_tokens_per_s']:.0f} tok/s)", flush=True)
        for kind, s in r["steps"].items():
            ms = s["median_ms"]
            print(f"  {kind:<8} {s['steps']:5d} steps {s['total_s']:7.2f} s  "
                  f"median batch {s['median_batch']:5.0f}  "
                  "median ms " + " ".join(f"{k} {ms[k]:.2f}" for k in (*PHASES, "wall")), flush=True)
        for kind, prof in r["profiles"].items():
            print(f"  profile {kind}: {prof}", flush=True)
    name = f"engine_phases_{args.shape}"
    print(f"wrote {write_results(results, name, args.device, args.output)}")
    if tmp is not None:
        tmp.cleanup()


if __name__ == "__main__":
    main()
