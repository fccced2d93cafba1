"""Where a decode step of the embedded server's engine spends its time (no HTTP), and the paged
decode attention side by side: the Triton kernel against the gather + SDPA path.

B sequences (random prompts, temperature 1, top_k 20, N tokens each, ignore EOS) run through the
server's own scheduler, model runner and decode graphs in this process, once with each attention
implementation. For every decode-only step it times, on the host clock:

    schedule   the scheduler's plan (block accounting)
    step       forward + sampling + the one device->host copy (ModelRunner.step)
    record     appending the step's tokens to the sequences (StepOutput.record)

and then, with CUDA events on the final batch, the forward (graph replay) and the sampling alone,
plus one layer's decode attention at the final context length for both implementations.
`--unfused` adds a run with the first implementation where the attention and MLP blocks run their own
Hugging Face forwards instead of the fused ones (`server/fused_layers.py`).

    python bench/decode_step.py --random-qwen3 0.6b --device cuda [--batch 256] [--logprobs 8] [--unfused]
        [--window 256 --softcap 50]   (one layer's attention also with a sliding window / soft-cap)

Writes bench/results/decode_step_<device>.json.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
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

from asyncgrpo.server import fused_layers
from asyncgrpo.server.attention import decode as attention
from asyncgrpo.server.attention.base import DECODE, SHARED
from asyncgrpo.server.attention.decode import GatherDecode
from asyncgrpo.server.attention.plan import resolve_plan
from asyncgrpo.server.kv_cache import PagedKVCache
from asyncgrpo.server.loading import load_served_model, resolve_device
from asyncgrpo.server.prefix_cache import BlockPool
from asyncgrpo.server.runner import ModelRunner
from asyncgrpo.server.sampling import sample
from asyncgrpo.server.scheduler import Scheduler
from asyncgrpo.server.sequence import SeqParams, Sequence
from asyncgrpo.server.step_graphs import StepGraphs

BLOCK_SIZE = 16
IMPLEMENTATIONS = {"triton": attention.decode_attention_triton, "gather": attention.decode_attention_gather}


def cuda_ms(fn, device, repeats: int = 20, graph: bool = False) -> float:
    """Median device time of fn() in ms (CUDA events), after two warm-up calls. `graph`: time replays
    of fn captured as a CUDA graph, as the server runs it (for kernels of a few microseconds, eager
    calls measure Python's launch cost instead)."""
    for _ in range(2):
        fn()
    if graph:
        captured = torch.cuda.CUDAGraph()
        with torch.cuda.graph(captured):
            fn()
        fn = captured.replay
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def generate(scheduler: Scheduler, runner: ModelRunner, prompts, params: SeqParams, max_len: int):
    """All prompts through the engine's loop; host times of each decode-only step."""
    seqs = [Sequence(i, f"r{i}", 0, p, params, max_model_len=max_len) for i, p in enumerate(prompts)]
    for s in seqs:
        scheduler.add(s)
    phases = {"schedule": [], "step": [], "record": []}
    start = time.perf_counter()
    last = None
    while scheduler.has_work():
        t0 = time.perf_counter()
        plan = scheduler.schedule()
        t1 = time.perf_counter()
        if not plan.prefill and len(plan.decode) == len(prompts):  # the inputs of the last full step
            last = [np.array(x) for x in zip(*((s.row, s.num_tokens, s.output[-1]) for s in plan.decode))]
        out = runner.step(plan.decode, plan.prefill)
        t2 = time.perf_counter()
        stepped = plan.sampled
        out.record(stepped, "v")
        for s in stepped:
            if s.finished:
                scheduler.remove(s)
        t3 = time.perf_counter()
        if not plan.prefill:
            phases["schedule"].append(t1 - t0)
            phases["step"].append(t2 - t1)
            phases["record"].append(t3 - t2)
    wall = time.perf_counter() - start
    return seqs, phases, last, wall


def time_parts(runner: ModelRunner) -> dict[str, list[float]]:
    """Wrap the parts of ModelRunner.step with host timers: how long the host spends in each
    (launches are asynchronous, so `to_host` also holds the wait for the device)."""
    from asyncgrpo.server import runner as runner_module
    from asyncgrpo.server import step_output

    parts: dict[str, list[float]] = {}

    def timed(name, fn):
        def wrapper(*a, **kw):
            t = time.perf_counter()
            out = fn(*a, **kw)
            parts.setdefault(name, []).append(time.perf_counter() - t)
            return out
        wrapper.__wrapped__ = fn
        return wrapper

    if runner.graphs is not None:
        runner.graphs.run = timed("forward_launch", runner.graphs.run)
        runner.graphs.sample = timed("sample_launch", runner.graphs.sample)
    runner._plan = timed("plan", runner._plan)
    runner_module.sample = timed("sample_launch", runner_module.sample)  # steps that sample eagerly
    # a class attribute: wrap the original, not the wrapper of an earlier call
    result = step_output.LaunchedStep.result
    step_output.LaunchedStep.result = timed("to_host", getattr(result, "__wrapped__", result))
    return parts


@contextlib.contextmanager
def own_forwards(model: torch.nn.Module):
    """The attention and MLP modules run their own forwards (fused_layers' ones are set aside)."""
    fused = (fused_layers._attention_forward, fused_layers._mlp_forward)
    saved = {m: m.__dict__.pop("forward") for m in model.modules()
             if isinstance(m.__dict__.get("forward"), functools.partial)
             and m.__dict__["forward"].func in fused}
    try:
        yield len(saved)
    finally:
        for module, forward in saved.items():
            module.forward = forward


def run_engine(served, args, prompts, impl: str) -> dict:
    """Generate for all prompts with one decode attention implementation: triton, the server's own plan
    (main() checks that it takes the kernel); gather, that plan with every decode row (groups sharing blocks
    included) read through the gather. Per-phase host times."""
    max_len = args.prompt_len + args.max_tokens + 16
    cache = PagedKVCache(served.num_layers, len(prompts) * max_len // BLOCK_SIZE, BLOCK_SIZE,
                         served.num_kv_heads, served.head_dim, served.dtype, served.device)
    scheduler = Scheduler(BlockPool(cache.num_blocks), BLOCK_SIZE, len(prompts), 1 << 20, max_len)
    cuda = served.device.type == "cuda"
    plan = resolve_plan(served.model, cache, served.device)
    if impl == "gather":
        for kind in (DECODE, SHARED):
            if kind in plan.backends:
                plan = plan.with_backend(kind, GatherDecode)
    graphs = StepGraphs(served.model, cache, plan, len(prompts), scheduler.max_blocks, cuda,
                        served.vocab_size)
    runner = ModelRunner(served.model, cache, plan, served.vocab_size, scheduler.block_table, graphs)
    params = SeqParams(
        temperature=1.0, top_k=args.top_k, top_p=1.0, min_p=0.0, seed=0, max_tokens=args.max_tokens,
        min_tokens=0, stop_token_ids=frozenset(), eos_token_id=None, extra_eos_ids=frozenset(),
        logprobs=args.logprobs or None, want_mask=False,
    )
    seqs, phases, last, wall = generate(scheduler, runner, prompts, params, max_len)  # captures the graphs
    parts = time_parts(runner)
    seqs, phases, last, wall = generate(scheduler, runner, prompts, params, max_len)
    phases.update(parts)
    tokens = sum(len(s.output) for s in seqs)
    result = {
        "tokens": tokens, "seconds": wall, "tokens_per_s": tokens / wall, "decode_steps": len(phases["step"]),
        "host_ms": {k: 1e3 * statistics.median(v) for k, v in phases.items()},
    }
    if cuda and last is not None:
        result["device_ms"] = device_breakdown(runner, last)
    return result


def device_breakdown(runner: ModelRunner, last_step: list[np.ndarray]) -> dict:
    """Forward (graph replay) and sampling (graph replay, and eager launches) alone on the last full
    batch's inputs, CUDA events."""
    from asyncgrpo.server.step_rows import decode_inputs

    rows, num_tokens, last_tokens = last_step
    dec = decode_inputs(last_tokens, num_tokens, rows, runner.block_table, runner.cache.block_size)
    logits = runner.graphs.run(dec).float()
    positions = num_tokens - runner.params.prompt_len[rows]
    plan = runner._plan(rows, positions)
    floats = torch.from_numpy(plan.floats).to(runner.device)
    ints = torch.from_numpy(plan.ints).to(runner.device)
    batch = plan.batch(floats, ints, runner.token_hashes)
    with torch.inference_mode():
        return {
            "forward": cuda_ms(lambda: runner.graphs.run(dec), runner.device),
            "sample_graph": cuda_ms(lambda: runner.graphs.sample(logits, plan, runner.token_hashes),
                                    runner.device),
            "sample_eager": cuda_ms(lambda: sample(logits, batch), runner.device),
        }


def attention_case(heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device,
                   batch: int, context: int) -> tuple[tuple, int]:
    """Inputs of one layer's decode attention, `context` cached tokens per sequence in shuffled blocks
    (the table padded to a power-of-two number of blocks, as the decode graphs do), and the bytes of
    K/V it reads."""
    g = torch.Generator(device=device).manual_seed(0)
    nb = -(-context // BLOCK_SIZE)
    shape = (batch * nb + 1, BLOCK_SIZE, kv_heads, head_dim)
    k_pool = torch.randn(shape, generator=g, device=device).to(dtype)
    v_pool = torch.randn(shape, generator=g, device=device).to(dtype)
    q = torch.randn(batch, heads, head_dim, generator=g, device=device).to(dtype)
    tables = torch.randperm(batch * nb, device=device).view(batch, nb)
    padded = 1 << (nb - 1).bit_length()
    tables = torch.cat([tables, tables[:, :1].expand(batch, padded - nb)], dim=1)
    lens = torch.full((batch,), context, device=device)
    kv_bytes = 2 * batch * context * kv_heads * head_dim * k_pool.element_size()
    return (q, k_pool, v_pool, tables, lens, head_dim**-0.5), kv_bytes


def attention_ms(served, batch: int, context: int, window: int | None = None,
                 softcap: float | None = None) -> dict:
    """One layer's decode attention over `context` cached tokens per sequence, both implementations,
    with a sliding window and a logit soft-cap when given (the K/V rate counts the keys the window holds)."""
    heads = served.model.config.get_text_config().num_attention_heads
    args, kv_bytes = attention_case(heads, served.num_kv_heads, served.head_dim, served.dtype, served.device,
                                    batch, context)
    kv_bytes = kv_bytes * min(window or context, context) // context
    out = {}
    for name, fn in IMPLEMENTATIONS.items():
        ms = cuda_ms(lambda fn=fn: fn(*args, window=window, softcap=softcap), served.device, graph=True)
        out[name] = {"ms": ms, "kv_gb_per_s": kv_bytes / ms / 1e6}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="asyncgrpo/tiny-chat")
    p.add_argument("--random-qwen3", choices=sorted(SHAPES), default=None)
    p.add_argument("--model-dir", default=None)
    p.add_argument("--device", default="cuda")
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--top-k", type=int, default=20)
    p.add_argument("--logprobs", type=int, default=0)
    p.add_argument("--implementations", default="triton,gather")
    p.add_argument("--unfused", action="store_true", help="also time the first implementation with the "
                   "model's own attention and MLP forwards")
    p.add_argument("--window", type=int, default=None,
                   help="time one layer's decode attention with this sliding window too (Gemma 2: 4096, "
                   "Gemma 3: 512 or 1024)")
    p.add_argument("--softcap", type=float, default=None, help="... and this logit soft-cap (Gemma 2: 50)")
    p.add_argument("--output", default=None)
    args = p.parse_args()
    model, tmp = prepare_model(args)
    device = resolve_device(args.device)
    served = load_served_model(model, device, "auto", None)
    prompts = make_prompts(args.batch, args.prompt_len, served.vocab_size)
    impls = args.implementations.split(",")
    if "triton" in impls and not (device.type == "cuda" and attention.triton_works_on(device, served.dtype)):
        print("the Triton kernel needs CUDA, Triton and a passing check on this device: timing the gather "
              "path only")
        impls = [i for i in impls if i != "triton"]
    results: dict = {"config": vars(args),
                     "host": {"platform": platform.platform(), "torch": torch.__version__,
                              "device_name": device_slug(args.device)},
                     "command": command_line(), "versions": package_versions()}
    results["engine"] = {}
    runs = [(impl, impl) for impl in impls]
    if args.unfused:
        runs.append((f"{impls[0]}_unfused_layers", impls[0]))
    for name, impl in runs:
        with (own_forwards(served.model) if name.endswith("unfused_layers")
              else contextlib.nullcontext(0)) as swapped:
            r = run_engine(served, args, prompts, impl)
        if swapped:
            r["modules_on_own_forwards"] = swapped
        results["engine"][name] = r
        print(f"{name:>7}: {r['tokens_per_s']:9.0f} tok/s over {r['decode_steps']} decode steps; host ms "
              + " ".join(f"{k} {v:.2f}" for k, v in r["host_ms"].items())
              + ("; device ms " + " ".join(f"{k} {v:.2f}" for k, v in r["device_ms"].items())
                 if "device_ms" in r else ""), flush=True)
    if len(impls) == 2:
        ratio = results["engine"]["triton"]["tokens_per_s"] / results["engine"]["gather"]["tokens_per_s"]
        print(f"engine tokens/s, triton / gather: {ratio:.2f}x")
    if args.unfused:
        e = results["engine"]
        print(f"engine tokens/s, fused / own attention and MLP forwards ({impls[0]} attention): "
              f"{e[impls[0]]['tokens_per_s'] / e[impls[0] + '_unfused_layers']['tokens_per_s']:.2f}x")
    if device.type == "cuda" and "triton" in impls:
        context = args.prompt_len + args.max_tokens
        a = attention_ms(served, args.batch, context)
        results["attention_one_layer"] = {"batch": args.batch, "context": context, **a}
        print(f"one layer's decode attention, B={args.batch}, context {context}: "
              + ", ".join(f"{k} {v['ms']:.3f} ms ({v['kv_gb_per_s']:.0f} GB/s of K/V)" for k, v in a.items())
              + f"; gather / triton {a['gather']['ms'] / a['triton']['ms']:.1f}x")
        if args.window is not None or args.softcap is not None:
            a = attention_ms(served, args.batch, context, args.window, args.softcap)
            results["attention_one_layer_windowed"] = {"batch": args.batch, "context": context,
                                                       "window": args.window, "softcap": args.softcap, **a}
            print(f"... with window {args.window} and soft-cap {args.softcap}: "
                  + ", ".join(f"{k} {v['ms']:.3f} ms ({v['kv_gb_per_s']:.0f} GB/s of K/V)"
                              for k, v in a.items())
                  + f"; gather / triton {a['gather']['ms'] / a['triton']['ms']:.1f}x")
    print(f"wrote {write_results(results, 'decode_step', args.device, args.output)}")
    if tmp is not None:
        tmp.cleanup()


if __name__ == "__main__":
    main()
