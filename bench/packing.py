"""Tree-packing benchmark: trained tokens per second of forward + backward, three layouts, two workloads.

The same GRPO-shaped samples (groups of `--num-generations` completions of one prompt) are split into
rows by `TokenBudgetBatcher` (one process) and trained three ways:

    tree        tree packing: shared prompts forwarded once, tree attention (FlexAttention on CUDA)
    padfree     padding-free packing without sharing: same attention path, each sample its own root
    padded      a padded batch of the same samples, plain transformers SDPA with an attention mask

A Gated DeltaNet hybrid (`qwen3.5-*` shapes) adds

    tree_torch  tree packing with the pure-PyTorch chunked delta rule, where `tree` takes fla-core's
                Triton kernel when it is installed (CUDA), so the two compare the kernels

Workloads (`--workloads`, each its own samples and rows; explicit sizes on the command line win):

    default        512-token prompts, completions of 256-2048 tokens (packing ratio about 1.35)
    shared-prompt  long shared prompts of 1280-2048 tokens, completions of 256-512 (ratio about 3.4)

Each step is forward (gradient checkpointing) + the chunked log-prob head of
`asyncgrpo.train.logprobs` at the trained tokens + backward of an advantage-weighted surrogate.
There is no optimizer step. Models are random-initialised Qwen3 / Qwen3.5 shapes in bf16 (no hub).
`--variants` times faster paths side by side (bench/step_options.py: compiled layers, fused log-prob
head, no checkpointing, liger-kernel) on `--variant-layouts`, each on a copy of the model, with its
log-probs checked against the base path's on the same row.

MFU counts the FLOPs the layout must do, with no credit for recomputation or padding:
6 * N_body * forwarded tokens + 6 * V * H * trained tokens (the LM head runs only there) +
3 * 4 * full-attention layers * heads * head_dim * attended pairs + on hybrids, per token, linear layer
and value head, 6 * (C (2.5 K + 1.5 V) + 3 K V) for the chunked delta rule's multiply-adds (chunk
C = 64): the trainer's FLOP model (`asyncgrpo.train.flops`, `perf/*_mfu`). The peak is the trainer's
too: the device's dense bf16 datasheet figure (`PEAK_TFLOPS`, H100/H200 SXM: 989.4 TFLOP/s), or
--peak-tflops. `mfu_of_matmul` divides by what one 8192^3 bf16 matmul reaches on the device instead
(measured once per run; about 790 TFLOP/s on the H200 here, the figure earlier results used as peak).
The tree row's attended pairs are its own (`PackedRow.attention_pairs`); the other layouts attend
sum(L (L + 1) / 2).

    python bench/packing.py                       # CPU smoke run, tiny configs (< 1 min)
    python bench/packing.py --device cuda         # Qwen3-0.6B and -1.7B shapes, default workload
    python bench/packing.py --device cuda --workloads default shared-prompt \\
        --variants base compile+head compile+head+nockpt
    python bench/packing.py --device cuda --models qwen3.5-2b --out bench/results/packing_hybrid_cuda.json

Writes bench/results/packing_<device>.json unless --out says otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
import traceback
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import torch
from provenance import command_line, package_versions
from random_qwen3 import QWEN3_VOCAB_SIZE
from random_qwen3 import SHAPES as QWEN3_SHAPES

SHAPES = {  # Qwen3 configs of the released checkpoints, with their full vocabulary (tied embeddings)
    **{f"qwen3-{size}": {**QWEN3_SHAPES[size], "vocab_size": QWEN3_VOCAB_SIZE} for size in ("0.6b", "1.7b")},
    "tiny": QWEN3_SHAPES["tiny"],
}
HYBRID_SHAPES = {  # Qwen3.5 text models: three Gated DeltaNet layers per full-attention layer
    "qwen3.5-2b": {"hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 24,
                       "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 256,
                       "linear_num_key_heads": 16, "linear_num_value_heads": 16, "linear_key_head_dim": 128,
                       "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "vocab_size": 248320,
                       "tie_word_embeddings": True},
    "tiny-hybrid": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
                        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
                        "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16,
                        "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4, "vocab_size": 512,
                        "tie_word_embeddings": True},
}


def make_config(shape):
    """The transformers config of a shape: Qwen3 (`SHAPES`) or a Qwen3.5 hybrid (`HYBRID_SHAPES`)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if shape in HYBRID_SHAPES:
        return CONFIG_MAPPING["qwen3_5_text"](**HYBRID_SHAPES[shape], max_position_embeddings=65536,
                                              attention_dropout=0.0)
    return CONFIG_MAPPING["qwen3"](**SHAPES[shape], max_position_embeddings=8192, attention_dropout=0.0)


def step_flops(config, n_body, tokens, trained, pairs):
    """FLOPs of forward + backward that a layout must do (module docstring): body, LM head at the trained
    tokens, attention over the attended pairs, a hybrid's delta rule: the trainer's FLOP model
    (`perf/*_mfu`)."""
    from asyncgrpo.train.flops import FlopModel

    return FlopModel.for_config(config, n_body).step_flops(tokens, trained, pairs)


# Per workload, the sizes a device type runs unless the command line gives them (cuda, cpu).
WORKLOADS = {
    "default": {"cuda": {"groups": 20, "prompt_len": 512, "max_prompt_len": 512, "min_completion": 256,
                         "max_completion": 2048},
                "cpu": {"groups": 6, "prompt_len": 64, "max_prompt_len": 64, "min_completion": 32,
                        "max_completion": 192}},
    "shared-prompt": {"cuda": {"groups": 40, "prompt_len": 1280, "max_prompt_len": 2048,
                               "min_completion": 256, "max_completion": 512},
                      "cpu": {"groups": 14, "prompt_len": 96, "max_prompt_len": 160, "min_completion": 16,
                              "max_completion": 40}},
}


def make_samples(rng, num_groups, num_generations, prompt_len, min_completion, max_completion, vocab,
                 max_prompt_len=None):
    """GRPO groups of random tokens: per group one prompt of prompt_len..max_prompt_len tokens (exactly
    prompt_len when max_prompt_len is None), `num_generations` completions of min..max_completion."""
    from asyncgrpo.packing import Sample

    samples = []
    for group in range(num_groups):
        length = prompt_len if max_prompt_len is None else int(rng.integers(prompt_len, max_prompt_len + 1))
        prompt = rng.integers(0, vocab, length)
        for _ in range(num_generations):
            completion = rng.integers(0, vocab, int(rng.integers(min_completion, max_completion + 1)))
            tokens = np.concatenate([prompt, completion])
            mask = np.arange(tokens.size) >= length
            samples.append(Sample(tokens, mask, np.where(mask, -1.0, 0.0), float(rng.normal()), group))
    return samples


def make_rows(samples, token_budget):
    from asyncgrpo.packing import TokenBudgetBatcher

    batcher = TokenBudgetBatcher(token_budget=token_budget, num_processes=1)
    rows = [mb.rows[0] for s in samples for mb in batcher.add(s)]
    rows += [mb.rows[0] for mb in batcher.flush()]
    return rows


class Layout:
    """Turns a list of samples into model inputs and the trained-token index of one layout."""

    def __init__(self, name, device, mask_capacity=None, kernel_options=None):
        self.name, self.device = name, device
        self.mask_capacity, self.kernel_options = mask_capacity, kernel_options

    @classmethod
    def for_variant(cls, name, device, options, rows, token_budget):
        """The layout of a step variant's rows: under `flash` their masks carry FlashAttention-4's kernel
        options and, since it takes no symbolic size in a mask, tensors padded to one size: the token
        budget (a tree row's most), or a padding-free layout's longest row (its prompts repeated)."""
        from step_options import flex_kernel_options

        kernel_options = flex_kernel_options(options)
        if kernel_options is None:
            return cls(name, device)
        longest = max(sum(s.num_tokens for s in r) for r in rows) if name == "padfree" else token_budget
        return cls(name, device, mask_capacity=longest, kernel_options=kernel_options)

    def prepare(self, samples):
        from asyncgrpo.packing import pack_row
        from asyncgrpo.packing.attention import TreeMask

        dev = self.device
        if self.name in ("tree", "tree_torch", "padfree"):
            row = pack_row(samples, share_prefixes=self.name != "padfree").to(dev)
            mask = TreeMask.from_row(row, deltanet_backend="torch" if self.name == "tree_torch" else "auto",
                                     mask_capacity=self.mask_capacity, kernel_options=self.kernel_options)
            return {"kind": "row", "ids": row.input_ids[None], "pos": row.position_ids[None], "mask": mask,
                        "pred": row.pred_index, "target": row.target_ids, "adv": row.advantages,
                        "tokens": row.num_tokens, "pairs": row.attention_pairs, "trained": row.num_trained}
        length = max(s.num_tokens for s in samples)
        ids = torch.zeros(len(samples), length, dtype=torch.long)
        attn = torch.zeros(len(samples), length, dtype=torch.long)
        pred, target, adv = [], [], []
        for b, s in enumerate(samples):
            ids[b, : s.num_tokens] = torch.from_numpy(s.token_ids.astype(np.int64))
            attn[b, : s.num_tokens] = 1
            t = torch.from_numpy(np.flatnonzero(s.trained_mask))
            pred.append(b * length + t - 1)
            target.append(ids[b, t])
            adv.append(torch.full((t.numel(),), s.advantage))
        lengths = [s.num_tokens for s in samples]
        return {"kind": "padded", "ids": ids.to(dev), "attn": attn.to(dev), "pred": torch.cat(pred).to(dev),
                    "target": torch.cat(target).to(dev), "adv": torch.cat(adv).to(dev),
                    "tokens": sum(lengths), "pairs": sum(n * (n + 1) // 2 for n in lengths),
                    "trained": sum(s.num_trained for s in samples), "slots": ids.numel()}


def hidden_states(model, batch):
    from asyncgrpo.packing.attention import tree_attention_context

    if batch["kind"] == "row":
        with tree_attention_context(batch["mask"]):
            out = model.model(input_ids=batch["ids"], position_ids=batch["pos"])
    else:
        out = model.model(input_ids=batch["ids"], attention_mask=batch["attn"])
    return out.last_hidden_state.flatten(0, 1)


def fwd_bwd(model, batch, chunk_size, fused_head=False):
    from asyncgrpo.train.logprobs import token_logprobs

    hidden = hidden_states(model, batch)
    lp = token_logprobs(hidden, model.lm_head.weight, batch["pred"], batch["target"], chunk_size=chunk_size,
                        fused=fused_head)
    loss = -(lp.target_logprobs * batch["adv"]).sum() / batch["trained"]
    loss.backward()
    return lp.target_logprobs.detach()


def set_layout(model, name):
    from asyncgrpo.packing.attention import disable_tree_attention, enable_tree_attention

    if name == "padded":
        disable_tree_attention(model, "sdpa")
    else:
        enable_tree_attention(model)


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def logprob_diff(model, samples, device):
    """Max |packed - unpacked| bf16 log-prob of trained tokens: tree row vs each sample alone (SDPA)."""
    from asyncgrpo.train.logprobs import token_logprobs

    with torch.no_grad():
        set_layout(model, "tree")
        tree = Layout("tree", device).prepare(samples)
        packed = token_logprobs(hidden_states(model, tree), model.lm_head.weight, tree["pred"],
                                tree["target"])
        set_layout(model, "padded")
        alone = []
        for s in samples:
            one = Layout("padded", device).prepare([s])
            alone.append(token_logprobs(hidden_states(model, one), model.lm_head.weight, one["pred"],
                                        one["target"]).target_logprobs)
    return float((packed.target_logprobs - torch.cat(alone)).abs().max())


def time_layout(model, name, rows, args, device, options):
    """Warm up on the first rows, time forward + backward on the rest: one layout's result entry
    (an "error" entry when the GPU runs out of memory, or when a variant's optional path fails), and the
    first timed row's log-probs."""
    from step_options import StepOptions, variant_scope

    set_layout(model, name)
    layout = Layout.for_variant(name, device, options, rows, args.token_budget)
    batches = [layout.prepare(r) for r in rows]
    first_logprobs = None
    try:
        with variant_scope(options, args.sac_budget):
            warmup_start = time.perf_counter()
            for batch in batches[: args.warmup]:
                fwd_bwd(model, batch, args.chunk_size, fused_head=options.head)
                model.zero_grad(set_to_none=True)
            sync(device)
            warmup_s = time.perf_counter() - warmup_start  # compilation included
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats()
            elapsed = 0.0
            for batch in batches[args.warmup:]:
                sync(device)
                start = time.perf_counter()
                lp = fwd_bwd(model, batch, args.chunk_size, fused_head=options.head)
                sync(device)
                elapsed += time.perf_counter() - start
                first_logprobs = lp if first_logprobs is None else first_logprobs
                model.zero_grad(set_to_none=True)
    except torch.cuda.OutOfMemoryError as exc:
        model.zero_grad(set_to_none=True)
        return {"error": f"out of memory: {str(exc).splitlines()[0]}"}, None
    # an optional path (FlashAttention-4, liger-kernel) that fails here is a result too
    except Exception as exc:
        if options == StepOptions():
            raise
        traceback.print_exc()
        model.zero_grad(set_to_none=True)
        return {"error": f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0][:300]}"}, None
    timed = batches[args.warmup:]
    tokens, trained = sum(b["tokens"] for b in timed), sum(b["trained"] for b in timed)
    flops = step_flops(model.config, args.n_body, tokens, trained, sum(b["pairs"] for b in timed))
    entry = {
        "trained_tokens_per_s": trained / elapsed,
        "fwd_bwd_s_per_row": elapsed / len(timed),
        "tokens_per_row": tokens / len(timed),
        "tflops": flops / elapsed / 1e12,
        "mfu": flops / elapsed / (args.peak_tflops * 1e12),
        "mfu_of_matmul": flops / elapsed / (args.matmul_tflops * 1e12) if args.matmul_tflops else None,
        "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None,
        "warmup_s": warmup_s,
    }
    if name == "padded":
        entry["pad_frac"] = 1 - tokens / sum(b["slots"] for b in timed)
    return entry, first_logprobs


def speedups(result):
    """Tree over each other layout of one entry set (trained tokens per second)."""
    out = {}
    for other in ("padfree", "padded", "tree_torch"):
        if "error" not in result.get("tree", {"error": 1}) and "error" not in result.get(other, {"error": 1}):
            out[f"speedup_vs_{other}"] = (result["tree"]["trained_tokens_per_s"]
                                          / result[other]["trained_tokens_per_s"])
    return out


def bench_model(shape, workload, args, device):
    from step_options import StepOptions, prepare_model
    from transformers import AutoModelForCausalLM

    from asyncgrpo.packing.attention import enable_tree_attention
    from asyncgrpo.packing.recurrent import DeltaRuleShape, resolve_delta_rule_backend

    config = make_config(shape)
    hybrid = "linear_attention" in config.layer_types
    layouts = ("tree", "tree_torch", "padfree", "padded") if hybrid else ("tree", "padfree", "padded")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    kernel_shape = DeltaRuleShape(config.linear_num_value_heads, config.linear_key_head_dim,
                                  config.linear_value_head_dim, dtype) if hybrid else None
    if (hybrid and device.type == "cuda"
            and resolve_delta_rule_backend("auto", device, kernel_shape) == "torch"):
        layouts = ("tree", "padfree", "padded")  # "tree" already runs the PyTorch delta rule
    if args.layouts:
        layouts = tuple(name for name in layouts if name in args.layouts or name == "tree")
    torch.manual_seed(0)
    with device:  # random initialisation on the GPU: seconds instead of a CPU pass over every weight
        base_model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=dtype)
    base_model.to(device)
    base_model.train()
    enable_tree_attention(base_model)
    args.n_body = sum(p.numel() for n, p in base_model.named_parameters() if ".layers." in n)

    rng = np.random.default_rng(args.seed)
    samples = make_samples(rng, workload["groups"], args.num_generations, workload["prompt_len"],
                           workload["min_completion"], workload["max_completion"], config.vocab_size,
                           workload["max_prompt_len"])
    rows = make_rows(samples, args.token_budget)
    needed = args.warmup + args.steps
    if len(rows) < needed:
        raise ValueError(f"{len(rows)} rows < warmup + steps = {needed}: raise --groups")
    rows = rows[:needed]
    raw = sum(sum(s.num_tokens for s in r) for r in rows[args.warmup:])
    result = {"workload": workload["name"], "shape": shape,
              "params": sum(p.numel() for p in base_model.parameters()), "rows": needed,
              "samples_per_row": float(np.mean([len(r) for r in rows])), "layouts": list(layouts),
              "variants": {}}
    if hybrid:
        result["tree_delta_rule"] = resolve_delta_rule_backend("auto", device, kernel_shape)
    base_logprobs = {}
    for variant in args.variants:
        options = StepOptions.parse(variant)
        model = prepare_model(base_model, options)
        entries = {}
        names = layouts if options == StepOptions() else [n for n in args.variant_layouts if n in layouts]
        for name in names:
            print(f"{workload['name']} {shape} {options.name}: {name} ...", flush=True)
            entries[name], logprobs = time_layout(model, name, rows, args, device, options)
            print(f"{workload['name']} {shape} {options.name} {name}: {json.dumps(entries[name])}",
                  flush=True)
            if logprobs is not None and options == StepOptions():
                base_logprobs[name] = logprobs
            elif logprobs is not None and name in base_logprobs:
                entries[name]["logprob_max_abs_diff_vs_base"] = float(
                    (logprobs - base_logprobs[name]).abs().max())
        entries.update(speedups(entries))
        if options == StepOptions():
            result.update(entries)
            if "error" not in entries["tree"]:
                result["packing_ratio"] = raw / (entries["tree"]["tokens_per_row"] * args.steps)
            model.eval()
            result["logprob_max_abs_diff"] = logprob_diff(model, rows[0][: args.diff_samples], device)
            result["logprob_dtype"] = str(dtype).replace("torch.", "")
            model.train()
            enable_tree_attention(model)
        else:
            result["variants"][options.name] = entries
            del model
        if device.type == "cuda":
            torch.cuda.empty_cache()
    del base_model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return result


def add_workload_arguments(parser: argparse.ArgumentParser) -> None:
    """The model shapes and the synthetic workload (shared with bench/fsdp_step.py and profile_step.py);
    None = the workload's size for the device (`WORKLOADS`)."""
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--models", nargs="+", default=None,
                        help=f"from {sorted(SHAPES)} (bench/packing.py also {sorted(HYBRID_SHAPES)})")
    parser.add_argument("--groups", type=int, default=None)
    parser.add_argument("--num-generations", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=None, help="(shortest) prompt length")
    parser.add_argument("--max-prompt-len", type=int, default=None, help="longest prompt length")
    parser.add_argument("--min-completion", type=int, default=None)
    parser.add_argument("--max-completion", type=int, default=None)
    parser.add_argument("--token-budget", type=int, default=None)
    parser.add_argument("--warmup", type=int, default=None)
    parser.add_argument("--steps", type=int, default=None)


def workload_sizes(name, args, device):
    """The sizes of workload `name` on `device`, where the command line gives none; "name" included."""
    if name not in WORKLOADS:
        raise SystemExit(f"unknown workload {name!r}; pick from {sorted(WORKLOADS)}")
    sizes = dict(WORKLOADS[name]["cuda" if device.type == "cuda" else "cpu"], name=name)
    for key in ("groups", "prompt_len", "max_prompt_len", "min_completion", "max_completion"):
        if getattr(args, key, None) is not None:
            sizes[key] = getattr(args, key)
    if args.prompt_len is not None and args.max_prompt_len is None:
        sizes["max_prompt_len"] = args.prompt_len
    return sizes


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_workload_arguments(parser)
    parser.add_argument("--workloads", nargs="+", default=["default"], help=f"from {sorted(WORKLOADS)}")
    parser.add_argument("--variants", nargs="+", default=["base"],
                        help="step variants, e.g. base compile+head compile+head+nockpt "
                        "(bench/step_options.py)")
    parser.add_argument("--variant-layouts", nargs="+", default=["tree", "padfree"],
                        help="the layouts the variants other than base run")
    parser.add_argument("--chunk-size", type=int, default=4096)
    parser.add_argument("--sac-budget", type=float, default=None,
                        help="the 'sac' variants' activation memory budget (the trainer's "
                        "activation_memory_budget; default: step_options.SAC_BUDGET)")
    parser.add_argument("--diff-samples", type=int, default=16)
    parser.add_argument("--peak-tflops", type=float, default=None,
                        help="default: the device's datasheet dense bf16 peak, as the trainer's perf/*_mfu")
    parser.add_argument("--layouts", nargs="+", choices=("tree_torch", "padfree", "padded"), default=None,
                        help="baselines to run next to tree (default: all)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    gpu = device.type == "cuda"
    defaults = {"models": ["qwen3-0.6b", "qwen3-1.7b"] if gpu else ["tiny", "tiny-hybrid"],
                "token_budget": 32768 if gpu else 1536, "warmup": 2 if gpu else 1, "steps": 4 if gpu else 2}
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    from peak import matmul_tflops, resolve_peak_tflops
    from step_options import SAC_BUDGET, StepOptions

    if args.sac_budget is None:
        args.sac_budget = SAC_BUDGET
    if not 0 < args.sac_budget <= 1:
        parser.error(f"--sac-budget {args.sac_budget} must be in (0, 1]")
    variants = [StepOptions.parse(v).name for v in args.variants]
    # base first: the reference
    args.variants = ["base"] + [v for v in dict.fromkeys(variants) if v != "base"]
    args.peak_tflops = resolve_peak_tflops(args.peak_tflops, device)
    args.matmul_tflops = matmul_tflops(device)

    results = [bench_model(shape, workload_sizes(w, args, device), args, device)
               for w in args.workloads for shape in args.models]
    from packing_table import print_table

    print_table(results)
    print(f"MFU against {args.peak_tflops:.1f} TFLOP/s"
          + (f"; one 8192^3 bf16 matmul reached {args.matmul_tflops:.0f} TFLOP/s"
             if args.matmul_tflops else ""))
    name = torch.cuda.get_device_name(device).replace(" ", "_") if gpu else platform.machine()
    out = Path(args.out or Path(__file__).parent / "results" / f"packing_{device.type}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"command": command_line(argv), "device": name, "versions": package_versions(),
            "args": {k: v for k, v in vars(args).items() if k != "n_body"}}
    out.write_text(json.dumps({"meta": meta, "results": results}, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
