"""Where a tree-packed training step's time goes: torch profiler over mask + forward + log-prob head +
backward.

The step is bench/packing.py's (tree attention, gradient checkpointing, the chunked log-prob head at the
trained tokens, backward of an advantage-weighted surrogate) on the same synthetic GRPO rows, one of
its workloads, in any of its step variants (bench/step_options.py). The device timeline is read from
the profiler's trace (bench/kernel_timeline.py): every kernel, copy and memset on the GPU, attributed
to the host range that launched it. Categories are exclusive and add up to the wall time:

    mask            building the row's attention masks (FlexAttention BlockMask; dense mask on CPU)
    logprob_head    the chunked LM head and log-softmax, forward and backward
    recompute       activation checkpointing's forward recomputation inside the backward pass
    attention_fwd   tree attention kernels of the forward pass
    attention_bwd   tree attention kernels of the backward pass
    matmul          GEMMs of the decoder body, forward and backward
    elementwise     norms, rotary, activations, residual adds, casts, reductions of the body
    copy            memcpy / memset
    idle            wall time with no kernel running: host gaps, launch latency, syncs

Concurrent kernels share their time, so busy time never exceeds the wall. `phases` splits each phase
(mask, forward, logprob_head, recompute, backward) into kernel kinds (matmul, attention, elementwise,
copy), which shows all matmul time and what recompute is made of. Recomputation is marked through
checkpointing's `context_fn`, except for compiled layers on transformers versions that checkpoint
inside the layer's forward (`recompute_marked`: false; it is then counted in the backward pass).
Without a GPU the outermost aten ops stand in for kernels (a smoke test of the attribution, not a
measurement).

    python bench/profile_step.py --device cuda --models qwen3-0.6b --workload shared-prompt \\
        --variants base compile+head

Writes bench/results/profile_<workload>_<model>_<variant>_<device>.json, a variant's `+` written `_`
(and a Chrome trace with --trace).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).parent))

import numpy as np
import torch
from kernel_timeline import (
    clip,
    complete_events,
    contains,
    device_kernels,
    labelled_ranges,
    outermost_host_ops,
    split_busy_time,
    union_length,
)
from packing import (
    Layout,
    add_workload_arguments,
    hidden_states,
    make_config,
    make_rows,
    make_samples,
    workload_sizes,
)
from provenance import command_line, package_versions
from step_options import StepOptions, prepare_model, variant_scope

MARK = "asyncgrpo::"  # prefix of this script's record_function ranges
PHASES = ("mask", "forward", "logprob_head", "recompute", "backward")
CATEGORIES = ("mask", "logprob_head", "recompute", "attention_fwd", "attention_bwd", "matmul", "elementwise",
              "copy")
MATMUL = re.compile(r"gemm|cutlass|xmma|nvjet|cublas|sm90_|sm80_|_mm_|"
                    r"aten::(linear|mm|addmm|bmm|matmul|baddbmm)$", re.IGNORECASE)
ATTENTION = re.compile(r"flash|fmha|flex_attention|attention|sdpa|triton_tem_", re.IGNORECASE)
COPY = re.compile(r"memcpy|memset", re.IGNORECASE)


def kernel_kind(name: str, in_attention_range: bool) -> str:
    if COPY.search(name):
        return "copy"
    if MATMUL.search(name):
        return "matmul"
    if in_attention_range or ATTENTION.search(name):
        return "attention"
    return "elementwise"


def host_labels(compiled_layers: bool) -> dict[str, tuple[str, ...]]:
    """Host ranges by label: this script's markers and the autograd nodes that identify a kernel's
    origin in the backward pass. With eager layers the only compiled autograd node outside the head
    is the compiled FlexAttention; compiled layers hold everything, so their kernels go by name."""
    labels = {p: (MARK + p,) for p in (*PHASES, "step", "attention")}
    labels["head_backward"] = ("_ChunkedLogprobsBackward",)
    attention_nodes = ["AttentionBackward", "FlashAttention", "EfficientAttention", "FlexAttention"]
    if not compiled_layers:
        attention_nodes.append("CompiledFunctionBackward")
    labels["attention_backward"] = tuple(f"evaluate_function: {n}" if n == "CompiledFunctionBackward" else n
                                         for n in attention_nodes)
    return labels


def attribute(kernel, ranges) -> tuple[str, str]:
    """(phase, category) of one kernel from the host ranges holding its launch."""
    t = kernel.launch
    in_range = {label: contains(spans, t) for label, spans in ranges.items()}
    if in_range["mask"]:
        phase = "mask"
    elif in_range["logprob_head"] or in_range["head_backward"]:
        phase = "logprob_head"
    elif in_range["recompute"]:
        phase = "recompute"
    elif in_range["forward"]:
        phase = "forward"
    elif in_range["backward"]:
        phase = "backward"
    else:
        phase = "other"
    kind = kernel_kind(kernel.name, in_range["attention"] or in_range["attention_backward"])
    if phase in ("mask", "logprob_head", "recompute"):
        category = phase
    elif kind == "attention":
        category = "attention_bwd" if phase == "backward" else "attention_fwd"
    else:
        category = kind
    return phase, category


def summarise(trace: dict, steps: int, gpu: bool, compiled_layers: bool) -> dict:
    """The per-step breakdown of a profiled run (module docstring): categories, phases by kernel kind,
    the host time of each phase and the kernels that took longest."""
    events = complete_events(trace)
    ranges = labelled_ranges(events, host_labels(compiled_layers))
    steps_spans = ranges["step"]
    wall = sum(e - s for s, e in steps_spans)
    kernels = device_kernels(events) if gpu else outermost_host_ops(events)
    labelled, by_kind, by_name = [], [], []
    for k in kernels:
        phase, category = attribute(k, ranges)
        labelled.append((k.start, k.end, category))
        by_kind.append((k.start, k.end, f"{phase}/{kernel_kind(k.name, category.startswith('attention'))}"))
        by_name.append((k.start, k.end, f"{category}|{k.name}"))
    busy = {label: t for label, t in split_busy_time(clip(labelled, steps_spans)).items()}
    union = union_length((s, e) for s, e, _ in clip(labelled, steps_spans))
    phase_kinds: dict[str, dict[str, float]] = defaultdict(dict)
    for label, t in split_busy_time(clip(by_kind, steps_spans)).items():
        phase, kind = label.split("/")
        phase_kinds[phase][kind] = t / 1e3 / steps
    per_name = split_busy_time(clip(by_name, steps_spans))
    ms = {c: busy.get(c, 0.0) / 1e3 / steps for c in CATEGORIES}
    ms["idle"] = (wall - union) / 1e3 / steps
    host_ms = {p: sum(e - s for s, e, _ in clip([(s, e, p) for s, e in ranges[p]], steps_spans)) / 1e3 / steps
               for p in PHASES}
    top = sorted(per_name.items(), key=lambda kv: -kv[1])[:25]
    return {
        "wall_ms_per_step": wall / 1e3 / steps,
        "device_busy_ms_per_step": union / 1e3 / steps,
        "idle_frac": (wall - union) / wall if wall else 0.0,
        "categories_ms_per_step": ms,
        "categories_frac": {c: v / (wall / 1e3 / steps) for c, v in ms.items()} if wall else {},
        "phases_device_ms_per_step": {p: dict(sorted(k.items())) for p, k in sorted(phase_kinds.items())},
        "phases_host_ms_per_step": host_ms,
        "num_kernels_per_step": len(kernels) / steps,
        "top_kernels": [{"name": key.split("|", 1)[1][:120], "category": key.split("|", 1)[0],
                         "ms_per_step": t / 1e3 / steps} for key, t in top],
    }


def marked_attention(function):
    """A transformers attention function whose calls are an "attention" host range."""
    def forward(*args, **kwargs):
        with torch.profiler.record_function(MARK + "attention"):
            return function(*args, **kwargs)
    return forward


def checkpoint_wraps_the_call() -> bool:
    """Whether transformers checkpoints a decoder layer around its `__call__` (then a compiled layer's
    recomputation can be marked), not inside `forward` (newer versions: inside the compiled region)."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    return "__call__" in GradientCheckpointingLayer.__dict__


def profiled_step(model, batch, args, device, options, windows):
    from asyncgrpo.packing.attention import TreeMask
    from asyncgrpo.train.logprobs import token_logprobs

    with torch.profiler.record_function(MARK + "step"):
        with torch.profiler.record_function(MARK + "mask"):
            batch["mask"] = TreeMask.from_row(batch["row"], device)
            batch["mask"].prebuild(windows)
        with torch.profiler.record_function(MARK + "forward"):
            hidden = hidden_states(model, batch)
        with torch.profiler.record_function(MARK + "logprob_head"):
            lp = token_logprobs(hidden, model.lm_head.weight, batch["pred"], batch["target"],
                                chunk_size=args.chunk_size, fused=options.head)
            loss = -(lp.target_logprobs * batch["adv"]).sum() / batch["trained"]
        with torch.profiler.record_function(MARK + "backward"):
            loss.backward()
        model.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)


def profile_variant(base_model, rows, options, args, device) -> tuple[dict, object]:
    from transformers import AttentionInterface

    from asyncgrpo.packing import pack_row
    from asyncgrpo.packing.attention import TREE_ATTENTION, attention_windows, tree_attention_forward

    gpu = device.type == "cuda"
    marker = lambda: torch.profiler.record_function(MARK + "recompute")
    if options.compile and not checkpoint_wraps_the_call():
        marker = None  # checkpointing inside the compiled forward takes no context_fn but dispatch modes
    model = prepare_model(base_model, options, recompute_context=marker)
    attention = tree_attention_forward if options.compile else marked_attention(tree_attention_forward)
    AttentionInterface.register(TREE_ATTENTION, attention)
    windows = attention_windows(model)
    layout = Layout.for_variant("tree", device, options, rows, args.token_budget)
    batches = []
    for r in rows:
        batch = layout.prepare(r)
        batch["row"] = pack_row(r).to(device)
        batches.append(batch)
    try:
        with variant_scope(options):
            for batch in batches[: args.warmup]:
                profiled_step(model, batch, args, device, options, windows)
            if gpu:
                torch.cuda.reset_peak_memory_stats()
            activities = ([torch.profiler.ProfilerActivity.CPU]
                          + ([torch.profiler.ProfilerActivity.CUDA] if gpu else []))
            with torch.profiler.profile(activities=activities) as prof:
                for batch in batches[args.warmup:]:
                    profiled_step(model, batch, args, device, options, windows)
    finally:
        AttentionInterface.register(TREE_ATTENTION, tree_attention_forward)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        trace = json.loads(path.read_text())
    timed = batches[args.warmup:]
    result = {
        "variant": options.name,
        "tokens_per_row": float(np.mean([b["tokens"] for b in timed])),
        "trained_per_row": float(np.mean([b["trained"] for b in timed])),
        "packing_ratio": (sum(sum(s.num_tokens for s in r) for r in rows[args.warmup:])
                          / sum(b["tokens"] for b in timed)),
        "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30 if gpu else None,
        "recompute_marked": marker is not None and not options.nockpt,
        **summarise(trace, len(timed), gpu, compiled_layers=options.compile),
    }
    if model is not base_model:
        del model
    return result, trace


def print_summary(result: dict) -> None:
    wall = result["wall_ms_per_step"]
    print(f"{result['workload']} {result['shape']} {result['variant']}: {wall:.1f} ms/step wall, "
          f"{result['device_busy_ms_per_step']:.1f} ms busy, {result['tokens_per_row']:.0f} tokens/row "
          f"(packing ratio {result['packing_ratio']:.2f})")
    for category, t in result["categories_ms_per_step"].items():
        print(f"    {category:<14} {t:>9.1f} ms  {t / wall:>6.1%}")
    for phase, kinds in result["phases_device_ms_per_step"].items():
        print(f"    {phase:<14} " + ", ".join(f"{k} {v:.1f}" for k, v in kinds.items()))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_workload_arguments(parser)
    parser.add_argument("--workload", default="default", help="a workload of bench/packing.py")
    parser.add_argument("--variants", nargs="+", default=["base"],
                        help="step variants (bench/step_options.py)")
    parser.add_argument("--chunk-size", type=int, default=4096)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--trace", action="store_true", help="also write the Chrome trace next to the JSON")
    parser.add_argument("--out-dir", default=str(Path(__file__).parent / "results"))
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    gpu = device.type == "cuda"
    defaults = {"models": ["qwen3-0.6b"] if gpu else ["tiny"], "token_budget": 32768 if gpu else 1024,
                "warmup": 2 if gpu else 1, "steps": 3 if gpu else 1}
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    workload = workload_sizes(args.workload, args, device)

    from transformers import AutoModelForCausalLM

    from asyncgrpo.packing.attention import enable_tree_attention

    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for shape in args.models:
        config = make_config(shape)
        torch.manual_seed(0)
        dtype = torch.bfloat16 if gpu else torch.float32
        with device:  # random initialisation on the GPU: seconds instead of a CPU pass over every weight
            base_model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=dtype)
        base_model.to(device)
        base_model.train()
        enable_tree_attention(base_model)
        rng = np.random.default_rng(args.seed)
        samples = make_samples(rng, workload["groups"], args.num_generations, workload["prompt_len"],
                               workload["min_completion"], workload["max_completion"], config.vocab_size,
                               workload["max_prompt_len"])
        rows = make_rows(samples, args.token_budget)[: args.warmup + args.steps]
        if len(rows) < args.warmup + args.steps:
            raise SystemExit(
                f"{len(rows)} rows < warmup + steps = {args.warmup + args.steps}: raise --groups")
        for variant in args.variants:
            options = StepOptions.parse(variant)
            start = time.perf_counter()
            result, trace = profile_variant(base_model, rows, options, args, device)
            result = {"workload": args.workload, "shape": shape,
                      "device": torch.cuda.get_device_name(device) if gpu else "cpu", **result,
                      "seconds": time.perf_counter() - start,
                      "command": command_line(argv), "versions": package_versions()}
            variant = options.name.replace("+", "_")  # file names without shell-special characters
            path = out / f"profile_{args.workload}_{shape}_{variant}_{'cuda' if gpu else 'cpu'}.json"
            path.write_text(json.dumps(result, indent=2) + "\n")
            if args.trace:
                path.with_suffix(".trace.json").write_text(json.dumps(trace))
            print_summary(result)
            print(f"wrote {path}")
        del base_model
        if gpu:
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
