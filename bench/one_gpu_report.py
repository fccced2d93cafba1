"""bench/one_gpu.py's reporting: the per-step progress line, the JSON file, and the comparison of the
asynchronous and on-policy runs of a shape (pure: medians and ratios of the runs' summaries)."""

from __future__ import annotations

import json
import os
import statistics
from pathlib import Path
from typing import Any

TRAINED_TARGET = 1.3  # the target: async trains >= 1.3x the tokens/s of on-policy on one GPU
SYNC_TARGET_S = 0.1  # and a weight sync over IPC takes <= 0.1 s (1.7B)


def write_json(path: Path, document: dict[str, Any]) -> None:
    """Replace `path` atomically (a reader, or a kill mid-write, never sees half a file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(document, indent=1, default=str))
    os.replace(tmp, path)


def _num(record: dict[str, Any], key: str) -> float:
    value = record.get(key)
    return float("nan") if value is None else float(value)


def progress_line(label: str, step: dict[str, Any]) -> str:
    """One line per logged step: time, step split, trained tokens, staleness, generated tokens so far."""
    return (
        f"[{label}] step {int(step['step'])} t={step['t_s']:.1f}s "
        f"step {_num(step, 'perf/step_s'):.2f}s (fwd_bwd {_num(step, 'perf/fwd_bwd_s'):.2f} "
        f"wait {_num(step, 'perf/rollout_wait_s'):.2f} sync {_num(step, 'perf/weight_sync_s'):.3f}) "
        f"trained {_num(step, 'batch/trained_tokens_per_step'):.0f} tok, "
        f"staleness {_num(step, 'sample/staleness_mean'):.2f}, reward {_num(step, 'reward'):.3f}, "
        f"server generated {_num(step, 'generated_tokens'):.0f} tok"
    )


def _medians(summaries: list[dict[str, Any]]) -> dict[str, Any]:
    keys = sorted({k for s in summaries for k, v in s.items() if isinstance(v, (int, float))})
    out: dict[str, Any] = {"runs": len(summaries)}
    for key in keys:
        values = [s[key] for s in summaries if isinstance(s.get(key), (int, float))]
        out[key] = statistics.median(values)
    return out


def _ratio(a: dict[str, Any] | None, b: dict[str, Any] | None, key: str) -> float | None:
    if not a or not b or not a.get(key) or not b.get(key):
        return None
    return a[key] / b[key]


def compare_settings(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians of the runs' summaries per setting ("async", "on_policy"; runs without steady steps are
    left out), the async / on-policy ratios, and the targets."""
    per_setting: dict[str, Any] = {}
    for name in ("async", "on_policy"):
        summaries = [r["summary"] for r in runs
                     if r.get("setting") == name and (r.get("summary") or {}).get("steady_steps")]
        per_setting[name] = _medians(summaries) if summaries else None
    a, o = per_setting["async"], per_setting["on_policy"]
    trained = _ratio(a, o, "trained_tokens_per_s")
    syncs = [s["mean_perf/weight_sync_s"] for s in (a, o) if s and "mean_perf/weight_sync_s" in s]
    sync_s = max(syncs) if syncs else None
    return {
        **per_setting,
        "async_over_on_policy": {
            "trained_tokens_per_s": trained,
            "generated_tokens_per_s": _ratio(a, o, "generated_tokens_per_s"),
            "step_s": _ratio(o, a, "mean_perf/step_s"),  # on-policy step time / async step time
        },
        "targets": {
            f"trained_tokens_per_s_async_over_on_policy_at_least_{TRAINED_TARGET}":
                None if trained is None else trained >= TRAINED_TARGET,
            f"weight_sync_s_at_most_{SYNC_TARGET_S}": None if sync_s is None else sync_s <= SYNC_TARGET_S,
            "weight_sync_s": sync_s,
        },
    }
