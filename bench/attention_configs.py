"""Launch configurations of the Triton decode attention, timed side by side.

For each batch size and context length (a Qwen3-0.6B-shaped layer: 16 query heads, 8 kv heads,
head size 128, bfloat16), times every (tile, warps, stages) of the grid with CUDA events, as replays
of a CUDA graph (as the server runs it), and prints the fastest next to the configuration
`decode_attention_triton` uses by default.

    python bench/attention_configs.py [--batches 1,16,64,256] [--contexts 384,2048]

Writes bench/results/attention_configs_<device>.json.
"""

from __future__ import annotations

import argparse
import inspect
import itertools
import platform
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from decode_step import attention_case, cuda_ms
from serve_throughput import device_slug, write_results

from asyncgrpo.server.decode_kernels import decode_attention_triton


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", default="1,16,64,256")
    p.add_argument("--contexts", default="384,2048")
    p.add_argument("--tiles", default="32,64,128")
    p.add_argument("--warps", default="2,4,8")
    p.add_argument("--stages", default="1,2,3,4")
    p.add_argument("--output", default=None)
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("attention_configs.py times CUDA kernels: run it on a machine with a GPU")
    device = torch.device("cuda")
    defaults = inspect.signature(decode_attention_triton).parameters
    default = (defaults["tile"].default, defaults["num_warps"].default, defaults["num_stages"].default)
    grid = list(itertools.product(*(map(int, v.split(",")) for v in (args.tiles, args.warps, args.stages))))
    if default not in grid:
        grid.append(default)
    results = {"config": vars(args), "default": dict(zip(("tile", "warps", "stages"), default)),
               "host": {"platform": platform.platform(), "torch": torch.__version__,
                        "device_name": device_slug("cuda")}, "cases": []}
    for batch, context in itertools.product(map(int, args.batches.split(",")),
                                            map(int, args.contexts.split(","))):
        inputs, kv_bytes = attention_case(16, 8, 128, torch.bfloat16, device, batch, context)
        times = {}
        for tile, warps, stages in grid:
            def run(inputs=inputs, tile=tile, warps=warps, stages=stages):
                return decode_attention_triton(*inputs, tile=tile, num_warps=warps, num_stages=stages)
            try:
                times[(tile, warps, stages)] = cuda_ms(run, device, graph=True)
            except Exception as exc:  # noqa: BLE001 -- a configuration that does not compile (shared memory)
                print(f"  tile {tile} warps {warps} stages {stages}: {type(exc).__name__}")
        best = min(times, key=times.get)
        case = {"batch": batch, "context": context, "default_ms": times[default], "best": best,
                "best_ms": times[best], "kv_gb_per_s_best": kv_bytes / times[best] / 1e6,
                "all_ms": {f"{t}/{w}/{s}": ms for (t, w, s), ms in times.items()}}
        results["cases"].append(case)
        print(f"B={batch:4d} context {context:5d}: default {default} {times[default]:.4f} ms, best {best} "
              f"{times[best]:.4f} ms ({times[default] / times[best]:.2f}x, "
              f"{case['kv_gb_per_s_best']:.0f} GB/s of K/V)",
              flush=True)
    print(f"wrote {write_results(results, 'attention_configs', 'cuda', args.output)}")


if __name__ == "__main__":
    main()
