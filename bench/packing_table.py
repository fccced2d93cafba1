"""The console table of bench/packing.py's results: one line per workload, model, variant and layout,
then the tree speedups (against the packing ratio) and the log-prob checks."""

from __future__ import annotations


def _row(label, name, e):
    if "error" in e:
        return f"{label:<34} {name:<10} {e['error'][:80]}"
    mem = f"{e['peak_memory_gib']:.1f}" if e["peak_memory_gib"] is not None else "-"
    return (f"{label:<34} {name:<10} {e['trained_tokens_per_s']:>14.0f} {e['fwd_bwd_s_per_row']:>8.3f} "
            f"{e['tokens_per_row']:>8.0f} {e['tflops']:>8.1f} {e['mfu']:>6.1%} {mem:>9}")


def print_table(results):
    print(f"{'workload / model / variant':<34} {'layout':<10} {'trained tok/s':>14} {'s/row':>8} {'tok/row':>8} "
          f"{'TFLOP/s':>8} {'MFU':>6} {'peak GiB':>9}")
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
                print(f"{label} {variant}: tree speedup vs padfree {entries['speedup_vs_padfree']:.2f} "
                      f"({entries['speedup_vs_padfree'] / ratio:.2f} x packing ratio {ratio:.2f})")
        others = [f"vs {n} {r[f'speedup_vs_{n}']:.2f}" for n in ("padded", "tree_torch") if f"speedup_vs_{n}" in r]
        print(f"{label}: samples/row {r['samples_per_row']:.1f}; base tree speedup {', '.join(others) or '-'}; "
              f"{r['logprob_dtype']} log-prob max diff {r['logprob_max_abs_diff']:.3g}")
        for variant, entries in r["variants"].items():
            diffs = [f"{n} {e['logprob_max_abs_diff_vs_base']:.3g}" for n, e in entries.items()
                     if isinstance(e, dict) and "logprob_max_abs_diff_vs_base" in e]
            if diffs:
                print(f"{label} {variant}: log-prob max diff vs base {', '.join(diffs)}")
        if "tree_delta_rule" in r:
            print(f"{label}: tree runs the {r['tree_delta_rule']} delta rule")
