"""The console table of bench/packing.py's results: one line per workload, model, variant and layout,
then the tree speedups (against the packing ratio, and against the FLOP ratio of the two layouts: the
speedup at equal MFU) and the log-prob checks. Also prints the table of a saved result:

    python bench/packing_table.py bench/results/packing_h100_workloads.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def _row(label, name, e):
    if "error" in e:
        return f"{label:<34} {name:<10} {e['error'][:80]}"
    mem = f"{e['peak_memory_gib']:.1f}" if e["peak_memory_gib"] is not None else "-"
    return (f"{label:<34} {name:<10} {e['trained_tokens_per_s']:>14.0f} {e['fwd_bwd_s_per_row']:>8.3f} "
            f"{e['tokens_per_row']:>8.0f} {e['tflops']:>8.1f} {e['mfu']:>6.1%} {mem:>9}")


def _flop_ratio(entries) -> float | None:
    """FLOPs of a padding-free row over those of its tree row (TFLOP/s x seconds per row)."""
    tree, padfree = entries.get("tree", {}), entries.get("padfree", {})
    if "tflops" not in tree or "tflops" not in padfree:
        return None
    return padfree["tflops"] * padfree["fwd_bwd_s_per_row"] / (tree["tflops"] * tree["fwd_bwd_s_per_row"])


def print_table(results):
    print(f"{'workload / model / variant':<34} {'layout':<10} {'trained tok/s':>14} {'s/row':>8} "
          f"{'tok/row':>8} {'TFLOP/s':>8} {'MFU':>6} {'peak GiB':>9}")
    for r in results:
        label = f"{r['workload']} {r['shape']}"
        for name in r["layouts"]:
            print(_row(f"{label} base", name, r[name]))
        for variant, entries in r["variants"].items():
            for name, e in entries.items():
                if isinstance(e, dict):
                    print(_row(f"{label} {variant}", name, e))
        ratio = r.get("packing_ratio")
        for variant, entries in [("base", r), *r["variants"].items()]:
            if "speedup_vs_padfree" in entries and ratio:
                flops = _flop_ratio(entries)
                at_equal_mfu = (f"; padfree/tree FLOPs {flops:.2f}, {flops / ratio:.2f} x the ratio"
                                if flops else "")
                print(f"{label} {variant}: tree speedup vs padfree {entries['speedup_vs_padfree']:.2f} "
                      f"({entries['speedup_vs_padfree'] / ratio:.2f} x packing ratio "
                      f"{ratio:.2f}{at_equal_mfu})")
        others = [f"vs {n} {r[f'speedup_vs_{n}']:.2f}" for n in ("padded", "tree_torch")
                  if f"speedup_vs_{n}" in r]
        print(f"{label}: samples/row {r['samples_per_row']:.1f}; base tree speedup "
              f"{', '.join(others) or '-'}; "
              f"{r['logprob_dtype']} log-prob max diff {r['logprob_max_abs_diff']:.3g}")
        for variant, entries in r["variants"].items():
            diffs = [f"{n} {e['logprob_max_abs_diff_vs_base']:.3g}" for n, e in entries.items()
                     if isinstance(e, dict) and "logprob_max_abs_diff_vs_base" in e]
            if diffs:
                print(f"{label} {variant}: log-prob max diff vs base {', '.join(diffs)}")
        if "tree_delta_rule" in r:
            print(f"{label}: tree runs the {r['tree_delta_rule']} delta rule")


if __name__ == "__main__":
    print_table(json.loads(Path(sys.argv[1]).read_text())["results"])
