"""Where a tree-packed training step's time goes: torch profiler over forward + log-prob head + backward.

The step is bench/packing.py's (`fwd_bwd`: tree attention, gradient checkpointing, the chunked
log-prob head at the trained tokens, backward of an advantage-weighted surrogate) on the same
synthetic GRPO rows. Device time is split by kernel name into categories, and the host gap is the
wall time no kernel ran:

    matmul      GEMMs (cuBLAS / CUTLASS)
    attention   FlexAttention / flash / SDPA kernels, forward and backward
    norm        RMSNorm
    rotary      rotary embedding
    activation  SiLU / GELU and the gating product
    elementwise other pointwise and reduction kernels (casts, adds, softmax of the log-prob head...)
    copy        memcpy / memset / cat
    other       the rest

Phases (CPU-side ranges, their device time): `mask` (building the row's block mask), `forward` (the
body), `logprob_head` (token_logprobs forward), `backward` (recompute + gradients, head included).

    python bench/profile_step.py --device cuda --models qwen3-0.6b --prompt-len 2048 --min-completion 256 \\
        --max-completion 512 --groups 16

Writes bench/results/profile_<model>_<device>.json (and a Chrome trace with --trace).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from collections import defaultdict
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).parent))

import numpy as np
import torch
from packing import SHAPES, Layout, add_workload_arguments, hidden_states, make_rows, make_samples

CATEGORIES = (  # first match wins
    ("attention", re.compile(r"flex|flash|fmha|attention|sdpa|triton_tem_fused", re.IGNORECASE)),
    ("matmul", re.compile(r"gemm|cutlass|xmma|sm90|sm80|cublas|matmul|nvjet|aten::(mm|addmm|bmm)$", re.IGNORECASE)),
    ("norm", re.compile(r"rms|norm", re.IGNORECASE)),
    ("rotary", re.compile(r"rotary|rope", re.IGNORECASE)),
    ("activation", re.compile(r"silu|gelu|swiglu|act_and_mul", re.IGNORECASE)),
    ("copy", re.compile(r"memcpy|memset|copy|cat_|CatArray", re.IGNORECASE)),
    ("elementwise", re.compile(r"elementwise|reduce|vectorized|softmax|logsumexp|scatter|gather|index", re.IGNORECASE)),
)
PHASES = ("mask", "forward", "logprob_head", "backward")


def category(kernel_name: str) -> str:
    for name, pattern in CATEGORIES:
        if pattern.search(kernel_name):
            return name
    return "other"


def profiled_step(model, batch, chunk_size):
    from asyncgrpo.packing.attention import TreeMask
    from asyncgrpo.train.logprobs import token_logprobs

    with torch.profiler.record_function("mask"):
        batch["mask"] = TreeMask.from_row(batch["row"], batch["device"])
    with torch.profiler.record_function("forward"):
        hidden = hidden_states(model, batch)
    with torch.profiler.record_function("logprob_head"):
        lp = token_logprobs(hidden, model.lm_head.weight, batch["pred"], batch["target"], chunk_size=chunk_size)
        loss = -(lp.target_logprobs * batch["adv"]).sum() / batch["trained"]
    with torch.profiler.record_function("backward"):
        loss.backward()


def summarise(prof, wall_s: float, steps: int, gpu: bool) -> dict:
    """Kernel time by category (on CPU: the self time of aten ops, a smoke test of the script)."""
    events = prof.key_averages()
    device_us = defaultdict(float)
    kernels = []
    for e in events:
        if gpu:
            t = getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0.0)
        else:
            t = e.self_cpu_time_total if e.key.startswith("aten::") else 0.0
        if t <= 0 or e.key in PHASES:
            continue
        device_us[category(e.key)] += t
        kernels.append((t, e.key, e.count))
    total_us = sum(device_us.values())
    phases = {}
    for e in events:
        if e.key in PHASES:
            t = (getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0.0)) if gpu else e.cpu_time_total
            phases[e.key] = t / 1e3 / steps
    kernels.sort(reverse=True)
    return {
        "wall_ms_per_step": wall_s * 1e3 / steps,
        "device_ms_per_step": total_us / 1e3 / steps,
        "host_gap_frac": max(0.0, 1.0 - total_us / 1e6 / wall_s),
        "categories_frac": {k: v / total_us for k, v in sorted(device_us.items(), key=lambda kv: -kv[1])},
        "phases_device_ms_per_step": phases,
        "top_kernels": [{"name": k[:120], "ms_per_step": t / 1e3 / steps, "calls": c, "category": category(k)}
                        for t, k, c in kernels[:25]],
    }


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_workload_arguments(parser)
    parser.add_argument("--chunk-size", type=int, default=4096)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-checkpointing", action="store_true", help="keep activations instead of recomputing")
    parser.add_argument("--trace", action="store_true", help="also write a Chrome trace next to the JSON")
    parser.add_argument("--out-dir", default=str(Path(__file__).parent / "results"))
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    gpu = device.type == "cuda"
    defaults = {"models": ["qwen3-0.6b"] if gpu else ["tiny"], "groups": 16 if gpu else 4,
                "prompt_len": 512 if gpu else 64, "min_completion": 256 if gpu else 32,
                "max_completion": 2048 if gpu else 96, "token_budget": 32768 if gpu else 1024,
                "warmup": 2 if gpu else 1, "steps": 3 if gpu else 1}
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)

    from transformers import AutoModelForCausalLM, Qwen3Config

    from asyncgrpo.packing import pack_row
    from asyncgrpo.packing.attention import enable_tree_attention

    for shape in args.models:
        config = Qwen3Config(**SHAPES[shape], max_position_embeddings=16384, attention_dropout=0.0)
        torch.manual_seed(0)
        dtype = torch.bfloat16 if gpu else torch.float32
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=dtype).to(device)
        model.train()
        model.config.use_cache = False
        if not args.no_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        enable_tree_attention(model)
        rng = np.random.default_rng(args.seed)
        samples = make_samples(rng, args.groups, args.num_generations, args.prompt_len, args.min_completion,
                               args.max_completion, config.vocab_size)
        rows = make_rows(samples, args.token_budget)[: args.warmup + args.steps]
        layout = Layout("tree", device)
        batches = []
        for r in rows:
            batch = layout.prepare(r)
            batch.update(row=pack_row(r).to(device), device=device)
            batches.append(batch)
        for batch in batches[: args.warmup]:
            profiled_step(model, batch, args.chunk_size)
            model.zero_grad(set_to_none=True)
        if gpu:
            torch.cuda.synchronize()
        activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if gpu else [])
        with torch.profiler.profile(activities=activities) as prof:
            start = time.perf_counter()
            for batch in batches[args.warmup:]:
                profiled_step(model, batch, args.chunk_size)
                model.zero_grad(set_to_none=True)
            if gpu:
                torch.cuda.synchronize()
            wall_s = time.perf_counter() - start
        timed = batches[args.warmup:]
        result = {
            "shape": shape, "device": torch.cuda.get_device_name(device) if gpu else "cpu",
            "checkpointing": not args.no_checkpointing, "tokens_per_row": float(np.mean([b["tokens"] for b in timed])),
            "trained_per_row": float(np.mean([b["trained"] for b in timed])),
            "packing_ratio": sum(sum(s.num_tokens for s in r) for r in rows[args.warmup:]) / sum(b["tokens"] for b in timed),
            "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30 if gpu else None,
            **summarise(prof, wall_s, len(timed), gpu),
            "command": "python bench/profile_step.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        }
        out = Path(args.out_dir)
        out.mkdir(parents=True, exist_ok=True)
        suffix = "nockpt_" if args.no_checkpointing else ""
        path = out / f"profile_{shape}_{suffix}{'cuda' if gpu else 'cpu'}.json"
        path.write_text(json.dumps(result, indent=2) + "\n")
        if args.trace:
            prof.export_chrome_trace(str(path.with_suffix(".trace.json")))
        print(json.dumps({k: v for k, v in result.items() if k != "top_kernels"}, indent=2))
        del model, batches
        if gpu:
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
