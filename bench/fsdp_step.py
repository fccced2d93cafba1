"""FSDP2 training-step benchmark on tree-packed rows: tokens/s per rank and in total, MFU, peak memory,
and the step loss checked against a one-process computation of the same rows.

Rows come from bench/packing.py (GRPO-shaped groups, `TokenBudgetBatcher` rows); step i gives rank r
the row i * N + r. Each rank runs the trainer's step without the rollout side: the forward through
the FSDP2 root (`hidden_states_and_head`), log-probs at the trained tokens (`token_logprobs`), the
policy loss (clipped surrogate) normalised by the trained tokens of all N rows and multiplied by N,
backward, AdamW. The model is a random Qwen3 shape of bench/packing.py, `fully_shard` per decoder
layer and at the root; on CUDA with fp32 master weights, bf16 compute and fp32 gradient reduction
(what `bf16=True` gives through accelerate), on CPU in fp32. The sampler's log-probs are set to the
uniform distribution's, which a random model is close to, so importance ratios stay near 1.

Loss check: before sharding, rank 0 computes step 0's loss over the same N rows in one process (the
unsharded model, same compute dtype, no gradient); the sharded step-0 loss summed over ranks must
equal it within bf16 tolerance (fp32 on CPU).

MFU counts 6 * N_body * forwarded tokens + 6 * V * H * trained tokens + 12 * layers * heads *
head_dim * attended pairs (bench/packing.py) per rank against --peak-tflops (default: the device's datasheet
dense bf16 peak, as the trainer's perf/*_mfu; bench/peak.py).

    torchrun --nproc_per_node 2 bench/fsdp_step.py --device cpu --out /tmp/fsdp_step.json   # smoke, gloo
    # 2 GPUs (the server elsewhere, or none: this is the training step alone)
    NCCL_NVLS_ENABLE=0 torchrun --nproc_per_node 2 bench/fsdp_step.py --models qwen3-0.6b qwen3-1.7b
    NCCL_NVLS_ENABLE=0 torchrun --nproc_per_node 1 bench/fsdp_step.py --models qwen3-0.6b qwen3-1.7b

Writes bench/results/fsdp_step_<device>_<N>.json (rank 0).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast stays off on shared GPUs

import numpy as np
import torch
import torch.distributed as dist
from packing import SHAPES, add_workload_arguments, make_rows, make_samples, step_flops


def row_loss(model, samples, num_trained_global: int, device: torch.device) -> tuple[torch.Tensor, dict]:
    """One rank's part of the step loss for its row, and the row's sizes."""
    from asyncgrpo.packing import pack_row
    from asyncgrpo.packing.attention import TreeMask, tree_attention_context
    from asyncgrpo.train.logprobs import token_logprobs
    from asyncgrpo.train.loss import policy_loss
    from asyncgrpo.train.model_setup import hidden_states_and_head

    row = pack_row(samples).to(device)
    with tree_attention_context(TreeMask.from_row(row, device)):
        hidden, head, _ = hidden_states_and_head(model, row.input_ids, row.position_ids)
        logps = token_logprobs(hidden, head.weight, row.pred_index, row.target_ids)
    loss = policy_loss(
        logps.target_logprobs, row.sampler_logprobs, row.advantages, row.completion_index,
        num_trained_tokens_global=num_trained_global, gradient_accumulation_steps=1, score_centering=False,
    ).loss
    sizes = {"tokens": row.num_tokens, "trained": row.num_trained, "pairs": row.attention_pairs}
    return loss, sizes


def build_model(shape: str, device: torch.device):
    from transformers import AutoModelForCausalLM, Qwen3Config

    from asyncgrpo.packing.attention import enable_tree_attention

    config = Qwen3Config(**SHAPES[shape], max_position_embeddings=8192, attention_dropout=0.0)
    torch.manual_seed(0)  # every rank builds the same weights before sharding
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).to(device)
    model.config.use_cache = False
    enable_tree_attention(model)
    return model


def shard(model, device: torch.device) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    mp_policy = MixedPrecisionPolicy()
    if device.type == "cuda":
        mp_policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp_policy)
    fully_shard(model, mesh=mesh, mp_policy=mp_policy)


def reference_loss(model, step_rows, num_trained: int, device: torch.device) -> float:
    """Step 0's loss as one process computes it: every row through the unsharded model."""
    compute = model if device.type == "cpu" else _bf16_copy(model)
    with torch.no_grad():
        return float(sum(row_loss(compute, rows, num_trained, device)[0] for rows in step_rows))


def _bf16_copy(model):
    import copy

    return copy.deepcopy(model).to(torch.bfloat16)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def bench_model(shape: str, args, device: torch.device) -> dict | None:
    rank, world = dist.get_rank(), dist.get_world_size()
    model = build_model(shape, device)
    config = model.config
    if args.checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    n_body = sum(p.numel() for n, p in model.named_parameters() if ".layers." in n)
    params = sum(p.numel() for p in model.parameters())

    rng = np.random.default_rng(args.seed)
    samples = make_samples(rng, args.groups, args.num_generations, args.prompt_len, args.min_completion,
                           args.max_completion, config.vocab_size)
    for s in samples:  # the uniform distribution's log-prob: importance ratios near 1 on a random model
        s.sampler_logprobs[s.trained_mask] = -np.log(config.vocab_size)
    rows = make_rows(samples, args.token_budget)
    steps = args.warmup + args.steps
    if len(rows) < steps * world:
        raise ValueError(f"{len(rows)} rows < (warmup + steps) * ranks = {steps * world}: raise --groups")
    step_rows = [rows[i * world:(i + 1) * world] for i in range(steps)]
    step_trained = [sum(s.num_trained for row in rs for s in row) for rs in step_rows]

    expected = reference_loss(model, step_rows[0], step_trained[0], device) if rank == 0 else None
    shard(model, device)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    timed = {"seconds": 0.0, "tokens": 0, "trained": 0, "pairs": 0}
    step0_loss = None
    for i, rs in enumerate(step_rows):
        sync(device)
        start = time.perf_counter()
        loss, sizes = row_loss(model, rs[rank], step_trained[i], device)
        (loss * world).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        sync(device)
        elapsed = time.perf_counter() - start
        if i == 0:
            total = loss.detach().float().clone()
            dist.all_reduce(total)
            step0_loss = float(total)
        if i >= args.warmup:
            timed["seconds"] += elapsed
            for key in ("tokens", "trained", "pairs"):
                timed[key] += sizes[key]
    flops = step_flops(config, n_body, timed["tokens"], timed["trained"], timed["pairs"])
    mine = {
        "rank": rank,
        "seconds_per_step": timed["seconds"] / args.steps,
        "tokens_per_s": timed["tokens"] / timed["seconds"],
        "trained_tokens_per_s": timed["trained"] / timed["seconds"],
        "tflops": flops / timed["seconds"] / 1e12,
        "mfu": flops / timed["seconds"] / (args.peak_tflops * 1e12),
        "peak_memory_gib": torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None,
    }
    per_rank: list = [None] * world
    dist.all_gather_object(per_rank, mine)
    del model, optimizer
    if device.type == "cuda":
        torch.cuda.empty_cache()
    if rank != 0:
        return None
    tolerance = 2e-2 * abs(expected) + 1e-3 if device.type == "cuda" else 1e-5 * abs(expected) + 1e-6
    slowest = max(r["seconds_per_step"] for r in per_rank)
    return {
        "shape": shape, "params": params, "ranks": world, "steps": args.steps,
        "tokens_per_row": timed["tokens"] / args.steps,
        "per_rank": per_rank,
        "total_tokens_per_s": sum(r["tokens_per_s"] * r["seconds_per_step"] for r in per_rank) / slowest,
        "total_trained_tokens_per_s": sum(r["trained_tokens_per_s"] * r["seconds_per_step"] for r in per_rank)
        / slowest,
        "mfu_mean": sum(r["mfu"] for r in per_rank) / world,
        "loss_step0": step0_loss, "loss_step0_one_process": expected,
        "loss_abs_diff": abs(step0_loss - expected), "loss_tolerance": tolerance,
        "loss_match": abs(step0_loss - expected) <= tolerance,
    }


def print_table(results: list[dict]) -> None:
    print(f"{'model':<12} {'rank':>4} {'s/step':>8} {'tok/s':>10} {'trained tok/s':>14} {'TFLOP/s':>8} "
          f"{'MFU':>6} {'peak GiB':>9}")
    for r in results:
        for e in r["per_rank"]:
            mem = f"{e['peak_memory_gib']:.1f}" if e["peak_memory_gib"] is not None else "-"
            print(f"{r['shape']:<12} {e['rank']:>4} {e['seconds_per_step']:>8.3f} {e['tokens_per_s']:>10.0f} "
                  f"{e['trained_tokens_per_s']:>14.0f} {e['tflops']:>8.1f} {e['mfu']:>6.1%} {mem:>9}")
        state = "equal" if r["loss_match"] else "DIFFERENT"
        print(f"{r['shape']:<12} total {r['total_tokens_per_s']:.0f} tok/s "
              f"({r['total_trained_tokens_per_s']:.0f} trained) on {r['ranks']} ranks, mean MFU "
              f"{r['mfu_mean']:.1%}; step-0 loss {r['loss_step0']:.6g} vs one process "
              f"{r['loss_step0_one_process']:.6g}: {state} (|diff| {r['loss_abs_diff']:.2g})")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_workload_arguments(parser)
    parser.add_argument("--no-checkpointing", dest="checkpointing", action="store_false",
                        help="No activation checkpointing (default: on, as in training).")
    parser.add_argument("--peak-tflops", type=float, default=None,
                        help="default: the device's datasheet dense bf16 peak (bench/peak.py)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    gpu = args.device == "cuda"
    world = int(os.environ.get("WORLD_SIZE", "1"))
    defaults = {"models": ["qwen3-0.6b", "qwen3-1.7b"] if gpu else ["tiny"],
                "groups": (24 if gpu else 4) * world + 4,
                "prompt_len": 512 if gpu else 32, "min_completion": 256 if gpu else 16,
                "max_completion": 2048 if gpu else 64, "token_budget": 32768 if gpu else 384,
                "warmup": 2 if gpu else 1, "steps": 4 if gpu else 2}
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)

    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if gpu:
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    from peak import resolve_peak_tflops

    args.peak_tflops = resolve_peak_tflops(args.peak_tflops, device)
    dist.init_process_group("nccl" if gpu else "gloo", device_id=device if gpu else None)
    try:
        results = [bench_model(shape, args, device) for shape in args.models]
        if dist.get_rank() == 0:
            print_table(results)
            name = torch.cuda.get_device_name(device).replace(" ", "_") if gpu else platform.machine()
            out = Path(args.out
                       or Path(__file__).parent / "results" / f"fsdp_step_{device.type}_{world}.json")
            out.parent.mkdir(parents=True, exist_ok=True)
            meta = {"device": name, "torch": torch.__version__, "args": vars(args)}
            out.write_text(json.dumps({"meta": meta, "results": results}, indent=2) + "\n")
            print(f"wrote {out}")
        ok = all(r["loss_match"] for r in results) if dist.get_rank() == 0 else True
        # leave together: a rank tearing down gloo while the other still writes results can abort
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    code = main()
    # the work is done, written and the group destroyed: skip the interpreter's teardown, where a C++
    # thread still joinable aborts a process; a rank once aborted after its work ("terminate called
    # without an active exception", one run in ~30 on 2 CPU ranks), failing a run that had succeeded
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
