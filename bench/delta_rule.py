"""Delta rule benchmark: forward + backward of ONE Gated DeltaNet layer's token mixing on packed rows.

Where the time of a hybrid's linear-attention layers goes, without the rest of the model. The rows are
bench/packing.py's GRPO rows (groups of `--num-generations` completions of 256-2048 tokens under one
512-token prompt, `TokenBudgetBatcher` rows of `--token-budget` tokens), in two layouts:

    tree      tree packing: each prompt forwarded once, its completions start from its final state
    padfree   the same samples packed without sharing: each sample its own root segment

and two parts, each timed as forward, then forward + backward (what a checkpointed layer does in the
backward pass: recompute + backward, so a training step costs about fwd + fwd_bwd):

    rule      `tree_gated_delta_rule` alone, on inputs distributed like a layer's (q/k/v/beta in
              --dtype, g float32 with decays exp(g) from about 1e-7 to 0.99)
    layer     `tree_deltanet_forward` of a real transformers Qwen3.5 Gated DeltaNet layer: projections,
              trie convolution, delta rule, gated norm, output projection

for each delta rule backend (`--backends`: torch, the pure-PyTorch chunked rule; fla, fla-core's Triton
kernel, CUDA only, where it imports). The shape is Qwen3.5-2B's (16 q/k and 16 value heads, K = V =
128, hidden 2048). `--profile` adds one profiled forward + backward per entry: on CUDA the device time
of every kernel, attributed to the innermost aten op that launched it (kernels per iteration, busy and
idle time), on CPU the ops' self time and the number of ops that would launch kernels (not view-like, no such
op nested in them).
`max_rel_err_vs_torch` compares each backend's forward with the torch one on the same inputs;
`rule_tflops` is the trainer's FLOP model of one layer's delta rule (`asyncgrpo.train.flops`, forward +
backward) over fwd_bwd_s (the layer part includes more than the rule).

    python bench/delta_rule.py                                   # CPU: 8k-token rows, rule only
    python bench/delta_rule.py --device cuda --profile           # H200: 32k-token rows, both parts

fla-core compiles and autotunes its kernels on first use on a machine (minutes at this shape with
Triton 3.7; `warmup_s` shows it): warm it once with `--backends fla --rows 1 --parts rule --repeats 1`.
    python bench/delta_rule.py --device cuda --backends torch --tf32 \\
        --out bench/results/delta_rule_cuda_tf32.json

Writes bench/results/delta_rule_<device>.json unless --out says otherwise.
"""

from __future__ import annotations

import argparse
import bisect
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).parent))

import numpy as np
import torch
import torch.nn.functional as F
from packing import HYBRID_SHAPES, make_config, make_rows, make_samples
from provenance import command_line, package_versions

SHAPE = "qwen3.5-2b"
DEFAULTS = {  # per device type: what runs unless the command line says otherwise
    "cuda": {"token_budget": 32768, "rows": 2, "warmup": 2, "repeats": 4, "parts": ["rule", "layer"],
             "dtype": "bfloat16"},
    "cpu": {"token_budget": 8192, "rows": 1, "warmup": 1, "repeats": 3, "parts": ["rule"],
            "dtype": "float32"},
}


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def rule_inputs(num_tokens, key_heads, heads, dim_k, dim_v, dtype, device, seed):
    """Raw (not normalised) q/k [T, Hk, K], v [T, H, V], g [T, H] float32, beta [T, H], as a layer makes
    them."""
    gen = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn(num_tokens, key_heads, dim_k, device=device, generator=gen).to(dtype)
    k = torch.randn(num_tokens, key_heads, dim_k, device=device, generator=gen).to(dtype)
    v = torch.randn(num_tokens, heads, dim_v, device=device, generator=gen).to(dtype)
    a_log = torch.empty(heads, device=device).uniform_(0.01, 16, generator=gen).log()
    g = -a_log.exp() * F.softplus(torch.randn(num_tokens, heads, device=device, generator=gen) + 1.0)
    beta = torch.sigmoid(torch.randn(num_tokens, heads, device=device, generator=gen)).to(dtype)
    return [x.requires_grad_() for x in (q, k, v, g, beta)]


def make_layer(dtype, device):
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet

    config = make_config(SHAPE)
    torch.manual_seed(0)
    with device:
        layer = Qwen3_5GatedDeltaNet(config, layer_idx=0)
    return layer.to(device=device, dtype=dtype).train()


class Case:
    """One (layout, part, backend) on one row: `run(backward)` does one forward (+ backward)."""

    def __init__(self, part, backend, row, layer, args, device, dtype):
        from asyncgrpo.packing.attention import TreeMask

        self.part, self.backend, self.device = part, backend, device
        self.mask = TreeMask.from_row(row.to(device), deltanet_backend=backend)
        self.tokens = row.num_tokens
        shape = HYBRID_SHAPES[SHAPE]
        heads, dim = shape["linear_num_value_heads"], shape["linear_value_head_dim"]
        if part == "rule":
            self.layout = self.mask.recurrent_layout(shape["linear_conv_kernel_dim"])
            self.inputs = rule_inputs(row.num_tokens, shape["linear_num_key_heads"], heads,
                                      shape["linear_key_head_dim"], dim, dtype, device, args.seed)
            self.weight = torch.randn(row.num_tokens, heads, dim, device=device)
        else:
            # seeded like rule_inputs: every backend gets the same hidden states, or max_rel_err_vs_torch
            # compares unrelated outputs (about sqrt(2))
            gen = torch.Generator(device=device).manual_seed(args.seed)
            self.layer = layer
            self.inputs = [torch.randn(1, row.num_tokens, shape["hidden_size"], device=device, generator=gen)
                           .to(dtype).requires_grad_()]
            self.weight = torch.randn(1, row.num_tokens, shape["hidden_size"], device=device, generator=gen)

    def forward(self):
        from asyncgrpo.packing.deltanet import tree_deltanet_forward
        from asyncgrpo.packing.recurrent import tree_gated_delta_rule

        if self.part == "rule":
            return tree_gated_delta_rule(*self.inputs, self.layout, backend=self.backend)
        return tree_deltanet_forward(self.layer, self.inputs[0], self.mask)

    def run(self, backward):
        out = self.forward()
        if backward:
            params = [] if self.part == "rule" else [p for p in self.layer.parameters() if p.requires_grad]
            torch.autograd.grad((out.float() * self.weight).sum(), self.inputs + params)
        return out


def time_case(case, args):
    """Median seconds of forward and of forward + backward over `repeats` runs after `warmup` (whose
    time, kernel compilation and autotuning included, is reported too)."""
    sync(case.device)
    start = time.perf_counter()
    for _ in range(args.warmup):
        case.run(backward=True)
    sync(case.device)
    times = {"warmup_s": time.perf_counter() - start}
    for backward in (False, True):
        samples = []
        for _ in range(args.repeats):
            sync(case.device)
            start = time.perf_counter()
            case.run(backward)
            sync(case.device)
            samples.append(time.perf_counter() - start)
        times["fwd_bwd_s" if backward else "fwd_s"] = statistics.median(samples)
    return times


NO_KERNEL_OPS = frozenset(f"aten::{name}" for name in (
    "view", "as_strided", "_reshape_alias", "reshape", "resolve_conj", "resolve_neg", "empty",
    "empty_strided", "empty_like", "detach", "_unsafe_view", "resize_", "expand", "transpose", "t", "slice",
    "select", "split", "split_with_sizes", "unbind", "permute", "unsqueeze", "squeeze", "flatten",
    "unflatten", "alias", "diagonal", "movedim", "lift_fresh", "narrow", "numpy_T", "view_as", "result_type",
    "stride"))


def innermost_op_at(ops_by_thread, tid, t):
    """Name of the innermost op of thread `tid` running at time t (None if none)."""
    starts, ops = ops_by_thread.get(tid, ([], []))
    for i in range(bisect.bisect_right(starts, t) - 1, -1, -1):
        _, end, name = ops[i]
        if end >= t:
            return name
    return None


def cpu_op_summary(ops, wall, top):
    """Self time per op (its duration less the ops nested in it, per thread), and how many ops would
    launch kernels on a GPU: aten ops that are not view-like and have no such op nested in them."""
    per_op = defaultdict(lambda: [0, 0.0])
    by_thread = defaultdict(list)
    for e in ops:
        by_thread[e["tid"]].append(e)
    computing = 0
    for thread_ops in by_thread.values():
        thread_ops.sort(key=lambda e: (e["ts"], -e["dur"]))
        stack = []  # [event, has a computing op nested]
        for e in [*thread_ops, None]:
            while stack and (e is None or stack[-1][0]["ts"] + stack[-1][0]["dur"] <= e["ts"]):
                event, nested = stack.pop()
                name = event["name"]
                computes = nested or (name.startswith("aten::") and name not in NO_KERNEL_OPS)
                computing += computes and not nested
                if stack:
                    stack[-1][1] = stack[-1][1] or computes
            if e is None:
                break
            if stack:
                per_op[stack[-1][0]["name"]][1] -= e["dur"] / 1e3
            per_op[e["name"]][0] += 1
            per_op[e["name"]][1] += e["dur"] / 1e3
            stack.append([e, False])
    rows = sorted(per_op.items(), key=lambda kv: -kv[1][1])
    return {"wall_ms": wall, "ops": len(ops), "kernel_ops": computing,
            "by_op": [{"op": k, "calls": c, "self_ms": round(ms, 3)} for k, (c, ms) in rows[:top]]}


def profile_summary(trace, gpu, top):
    """Per op: calls (CPU) or kernels (CUDA) and milliseconds, busiest first; totals of the profiled run."""
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    ops = [e for e in events if e.get("cat") == "cpu_op"]
    timed = ops + [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    wall = (max(e["ts"] + e["dur"] for e in timed) - min(e["ts"] for e in timed)) / 1e3 if timed else 0.0
    per_op = defaultdict(lambda: [0, 0.0])
    if not gpu:
        return cpu_op_summary(ops, wall, top)
    by_thread = defaultdict(list)
    for e in ops:
        by_thread[e["tid"]].append((e["ts"], e["ts"] + e["dur"], e["name"]))
    ops_by_thread = {}
    for tid, spans in by_thread.items():
        spans.sort()
        ops_by_thread[tid] = ([s[0] for s in spans], spans)
    launches = {e["args"]["correlation"]: e for e in events
                if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})}
    kernels = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    per_kernel = defaultdict(lambda: [0, 0.0])
    busy = []
    for k in kernels:
        launch = launches.get(k.get("args", {}).get("correlation"))
        op = innermost_op_at(ops_by_thread, launch["tid"], launch["ts"]) if launch else None
        per_op[op or "(no op)"][0] += 1
        per_op[op or "(no op)"][1] += k["dur"] / 1e3
        per_kernel[k["name"][:90]][0] += 1
        per_kernel[k["name"][:90]][1] += k["dur"] / 1e3
        busy.append((k["ts"], k["ts"] + k["dur"]))
    busy.sort()
    union, reach = 0.0, -float("inf")
    for start, end in busy:  # union of kernel intervals
        union += max(0.0, end - max(start, reach))
        reach = max(reach, end)
    rows = sorted(per_op.items(), key=lambda kv: -kv[1][1])
    kernel_rows = sorted(per_kernel.items(), key=lambda kv: -kv[1][1])
    return {"wall_ms": wall, "kernels": len(kernels), "device_busy_ms": union / 1e3,
            "by_op": [{"op": k, "kernels": c, "device_ms": round(ms, 3)} for k, (c, ms) in rows[:top]],
            "by_kernel": [{"kernel": k, "count": c, "device_ms": round(ms, 3)}
                          for k, (c, ms) in kernel_rows[:top]]}


def profile_case(case, gpu, top):
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if gpu else [])
    sync(case.device)
    with profile(activities=activities) as prof:
        case.run(backward=True)
        sync(case.device)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        trace = json.loads(path.read_text())
    return profile_summary(trace, gpu, top)


def available_backends(requested, device, dtype):
    """The requested backends that can train here, and {backend: why not} for the others."""
    from asyncgrpo.packing.recurrent import DeltaRuleShape, _fla_kernel, _fla_training_problem

    shape = HYBRID_SHAPES[SHAPE]
    kernel_shape = DeltaRuleShape(shape["linear_num_value_heads"], shape["linear_key_head_dim"],
                                  shape["linear_value_head_dim"], dtype)

    backends, skipped = [], {}
    for name in requested:
        if name == "fla":
            kernel, reason = _fla_kernel() if device.type == "cuda" else (None, "CUDA only")
            if kernel is not None:
                index = device.index if device.index is not None else torch.cuda.current_device()
                reason = _fla_training_problem(index, kernel_shape)
            if reason is not None:
                print(f"skipping backend fla: {reason}", flush=True)
                skipped[name] = reason
                continue
        backends.append(name)
    return backends, skipped


def rule_flops(num_tokens):
    """FLOPs of the delta rule's forward + backward over num_tokens, the trainer's model
    (`asyncgrpo.train.flops`)."""
    from asyncgrpo.train.flops import FlopModel

    config = make_config(SHAPE)
    config.layer_types = ["linear_attention"]
    return FlopModel.for_config(config, 0).recurrent_per_token * num_tokens


def row_stats(row, layout, chunk_size=64):
    lens = row.segment_len.numpy()
    return {"tokens": row.num_tokens, "segments": int(lens.size), "levels": len(layout.levels),
            "longest_segment": int(lens.max()),
            "chunks_if_chunk_padded": int(np.ceil(lens / chunk_size).sum())}


def print_profile(label, summary):
    unit = "device_ms" if "kernels" in summary else "self_ms"
    count = "kernels" if "kernels" in summary else "calls"
    head = f"  profile {label}: wall {summary['wall_ms']:.1f} ms"
    if "kernels" in summary:
        head += f", {summary['kernels']} kernels, device busy {summary['device_busy_ms']:.1f} ms"
    else:
        head += f", {summary['ops']} ops, {summary['kernel_ops']} that would launch kernels"
    print(head)
    for entry in summary["by_op"]:
        print(f"    {entry[unit]:9.2f} ms {entry[count]:6d}  {entry['op']}")
    for entry in summary.get("by_kernel", [])[:5]:
        print(f"    kernel {entry['device_ms']:9.2f} ms {entry['count']:6d}  {entry['kernel']}")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--backends", nargs="+", choices=("torch", "fla"), default=["torch", "fla"],
                        help="fla is skipped, saying why, where fla-core does not import or fails its "
                             "backward check on this GPU (Triton 3.4 to 3.7.0 on Hopper), and on CPU")
    parser.add_argument("--layouts", nargs="+", choices=("tree", "padfree"), default=["tree", "padfree"])
    parser.add_argument("--parts", nargs="+", choices=("rule", "layer"), default=None)
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default=None)
    parser.add_argument("--token-budget", type=int, default=None)
    parser.add_argument("--rows", type=int, default=None, help="rows timed (each its own tree)")
    parser.add_argument("--warmup", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--num-generations", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--min-completion", type=int, default=256)
    parser.add_argument("--max-completion", type=int, default=2048)
    parser.add_argument("--tf32", action="store_true",
                        help="float32 matmuls in TF32 (torch.set_float32_matmul_precision('high')): the "
                             "PyTorch delta rule's matmuls on tensor cores, at about bf16-input precision")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--top", type=int, default=15, help="ops listed per profile")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    gpu = device.type == "cuda"
    for key, value in DEFAULTS["cuda" if gpu else "cpu"].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    dtype = getattr(torch, args.dtype)
    if args.tf32:
        torch.set_float32_matmul_precision("high")

    from asyncgrpo.packing import pack_row

    samples = make_samples(np.random.default_rng(args.seed), args.groups, args.num_generations,
                           args.prompt_len, args.min_completion, args.max_completion, 1000)
    rows = make_rows(samples, args.token_budget)[: args.rows]
    backends, skipped = available_backends(args.backends, device, dtype)
    layer = make_layer(dtype, device) if "layer" in args.parts else None
    results = []
    for index, row_samples in enumerate(rows):
        for layout_name in args.layouts:
            row = pack_row(row_samples, share_prefixes=layout_name == "tree")
            sample_tokens = sum(s.num_tokens for s in row_samples)
            for part in args.parts:
                reference = None
                for backend in backends:
                    case = Case(part, backend, row, layer, args, device, dtype)
                    layout = case.mask.recurrent_layout(4)
                    if gpu:
                        torch.cuda.reset_peak_memory_stats(device)
                    entry = {"row": index, "layout": layout_name, "part": part, "backend": backend,
                             **row_stats(row, layout), "sample_tokens": sample_tokens,
                             **time_case(case, args)}
                    entry["ms_per_1k_tokens"] = 1e3 * entry["fwd_bwd_s"] / row.num_tokens * 1e3
                    entry["rule_tflops"] = rule_flops(row.num_tokens) / entry["fwd_bwd_s"] / 1e12
                    entry["sample_tokens_per_s"] = sample_tokens / entry["fwd_bwd_s"]
                    if gpu:
                        entry["peak_memory_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
                    with torch.no_grad():
                        out = case.forward().float()
                    if reference is None:
                        reference = out
                    else:
                        entry["max_rel_err_vs_torch"] = float((out - reference).norm() / reference.norm())
                    print(f"row {index} {layout_name} {part} {backend}: "
                          + json.dumps({k: (round(v, 5) if isinstance(v, float) else v)
                                        for k, v in entry.items()}),
                          flush=True)
                    if args.profile:
                        entry["profile"] = profile_case(case, gpu, args.top)
                        print_profile(f"{layout_name} {part} {backend}", entry["profile"])
                    results.append(entry)
                    del case
    name = torch.cuda.get_device_name(device).replace(" ", "_") if gpu else platform.machine()
    meta = {"command": command_line(), "device": name, "versions": package_versions(),
            "threads": torch.get_num_threads(), "skipped_backends": skipped, "args": vars(args)}
    out = Path(args.out or Path(__file__).parent / "results" / f"delta_rule_{device.type}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"meta": meta, "results": results}, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
