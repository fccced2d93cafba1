"""The trainer's fast paths against its eager path, per dtype: the differences that its start-up probe
(`asyncgrpo.train.fast_paths.probe_compiled_layers`) measures, on random Qwen3 shapes.

For each autocast dtype of training (float32: none; bfloat16; float16) and each set of tree-attention
kernels (FlexAttention's Triton kernels; FlashAttention-4 with `--kernels flash`, on Hopper or later with
the flash-attn-4 package), a fresh model of the shape (same seed, float32 weights as the trainer keeps
them) has its decoder layers compiled in place, and the probe runs under activation checkpointing, as a
training run does: one packed row of two completions of a shared prompt, forward and backward through the
layers and the log-prob head, compiled (fused head) against eager. Reported per case: the relative
difference of the hidden states and of the log-probs, the largest log-prob difference, the gradients'
cosine, and the seconds the probe took (its compile included). Tolerances are not applied here: the
numbers are the point (the trainer's probe falls back to eager beyond PROBE_RTOL / PROBE_MIN_GRAD_COSINE).

    python bench/fast_path_exactness.py                                      # tiny shape on CPU (inductor)
    python bench/fast_path_exactness.py --shape 0.6b --device cuda --kernels triton flash
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import time
import types
from pathlib import Path

import torch

from provenance import command_line
from random_qwen3 import SHAPES

DTYPES = {"float32": None, "bfloat16": torch.bfloat16, "float16": torch.float16}


def build_model(shape: str, device: str, seed: int = 0) -> torch.nn.Module:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from asyncgrpo.packing.attention import enable_tree_attention

    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(Qwen3Config(**SHAPES[shape], max_position_embeddings=4096)).float().to(device)
    model.config.use_cache = False
    enable_tree_attention(model)
    return model


def measure(shape: str, device: str, dtype: str, kernels: str, token_budget: int) -> dict:
    """One case: a fresh compiled model, the probe under checkpointing; its differences or its error."""
    from asyncgrpo.train.compiled_layers import compile_decoder_layers, flex_backend_options
    from asyncgrpo.train.fast_paths import checkpointed_as_in_training, probe_compiled_layers

    case = {"dtype": dtype, "kernels": kernels}
    torch._dynamo.reset()
    model = build_model(shape, device)
    started = time.perf_counter()
    try:
        options = flex_backend_options(kernels, device)
        compile_decoder_layers(model)
        with checkpointed_as_in_training(model, types.SimpleNamespace(gradient_checkpointing=True)):
            found = probe_compiled_layers(model, device, token_budget=token_budget, kernel_options=options,
                                          autocast_dtype=DTYPES[dtype], rtol=math.inf, min_grad_cosine=-1.0)
    except Exception as exc:  # a case that cannot run here is reported, and the others go on
        lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
        return {**case, "error": f"{type(exc).__name__}: {' '.join(lines[:2])[:500]}"}
    return {**case, **found, "probe_s": round(time.perf_counter() - started, 2)}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtypes", nargs="+", choices=sorted(DTYPES), default=list(DTYPES))
    p.add_argument("--kernels", nargs="+", choices=("triton", "flash"), default=["triton"])
    p.add_argument("--token-budget", type=int, default=4096,
                   help="FlashAttention-4's masks are padded to it, as in training.")
    p.add_argument("--output", default=None, help="Default: bench/results/fast_path_exactness_<device>.json")
    args = p.parse_args(argv)
    cuda = torch.device(args.device).type == "cuda"
    slug = (torch.cuda.get_device_name().lower().replace("nvidia ", "").split()[0] if cuda else "cpu")
    out = Path(args.output or Path(__file__).parent / "results" / f"fast_path_exactness_{slug}.json")
    report = {"command": command_line(), "shape": args.shape, "device": args.device,
              "gpu": torch.cuda.get_device_name() if cuda else None, "host": platform.node(),
              "torch": torch.__version__, "cases": []}
    for kernels in args.kernels:
        for dtype in args.dtypes:
            case = measure(args.shape, args.device, dtype, kernels, args.token_budget)
            report["cases"].append(case)
            shown = {k: (f"{v:.3g}" if isinstance(v, float) else v) for k, v in case.items()}
            print(json.dumps(shown), flush=True)
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {out}", flush=True)


if __name__ == "__main__":
    main()
