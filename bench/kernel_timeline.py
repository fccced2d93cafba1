"""Device time of a profiled run, read from its Chrome trace: which kernel ran when, launched from where.

`torch.profiler`'s aggregate tables (`key_averages`) add a kernel's time to every CPU op above it and
miss kernels launched from the autograd engine's own thread, so their totals exceed the wall time and
lose the backward pass. This module works on the trace's events instead:

- a kernel is a device interval (`kernel`, `gpu_memcpy`, `gpu_memset` events) with the host time of
  its launch (the runtime or driver call with the same `correlation` id);
- without a GPU (CPU smoke runs) the outermost `aten::` ops of each thread stand in for kernels;
- a kernel belongs to the labelled host ranges (`record_function` names, autograd nodes) that hold
  its launch time, whichever thread they ran on: the step's thread waits in `backward()` while the
  autograd thread launches, so time containment is the right test;
- busy time is split over the kernels running at each instant (`split_busy_time`): categories add
  up to the union of kernel intervals, never more than the wall time, and idle = wall - union.

All functions are pure (a parsed trace in, numbers out).
"""

from __future__ import annotations

import bisect
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass

DEVICE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
LAUNCH_CATEGORIES = ("cuda_runtime", "cuda_driver")


@dataclass(frozen=True)
class Kernel:
    """One device interval: `start`/`end` in the trace's microseconds, `launch` the host time it was
    launched at (its own start when the trace has no launch event, e.g. a CPU op)."""

    name: str
    start: float
    end: float
    launch: float


def complete_events(trace: dict) -> list[dict]:
    """The trace's complete ("X") events."""
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    return [e for e in events if e.get("ph") == "X" and "dur" in e]


def device_kernels(events: list[dict]) -> list[Kernel]:
    """GPU kernels, copies and memsets, each with the host time of the call that launched it."""
    launches = {}
    for e in events:
        if e.get("cat") in LAUNCH_CATEGORIES and "correlation" in e.get("args", {}):
            launches[e["args"]["correlation"]] = float(e["ts"])
    kernels = []
    for e in events:
        if e.get("cat") in DEVICE_CATEGORIES:
            start = float(e["ts"])
            launch = launches.get(e.get("args", {}).get("correlation"), start)
            kernels.append(Kernel(e["name"], start, start + float(e["dur"]), launch))
    return kernels


def outermost_host_ops(events: list[dict], prefix: str = "aten::") -> list[Kernel]:
    """The CPU stand-in for kernels: per thread, the `prefix` ops not nested in another one."""
    by_thread: dict = defaultdict(list)
    for e in events:
        if e.get("cat") == "cpu_op" and e["name"].startswith(prefix):
            by_thread[(e.get("pid"), e.get("tid"))].append((float(e["ts"]), float(e["dur"]), e["name"]))
    ops = []
    for spans in by_thread.values():
        spans.sort(key=lambda s: (s[0], -s[1]))
        covered_until = float("-inf")
        for ts, dur, name in spans:
            if ts >= covered_until:
                ops.append(Kernel(name, ts, ts + dur, ts))
                covered_until = ts + dur
    return ops


def labelled_ranges(
    events: list[dict], labels: dict[str, Iterable[str]]
) -> dict[str, list[tuple[float, float]]]:
    """Host ranges per label: an event belongs to a label when its name contains one of the label's
    patterns. Overlapping ranges of one label are merged; each label's list is sorted."""
    out: dict[str, list[tuple[float, float]]] = {}
    for label, patterns in labels.items():
        patterns = tuple(patterns)
        spans = [(float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in events
                 if e.get("cat") in ("user_annotation", "cpu_op") and any(p in e["name"] for p in patterns)]
        out[label] = merge_intervals(spans)
    return out


def merge_intervals(spans: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    """Sorted, non-overlapping union of intervals."""
    merged: list[list[float]] = []
    for start, end in sorted(spans):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(s, e) for s, e in merged]


def contains(ranges: list[tuple[float, float]], t: float) -> bool:
    """Whether a sorted, merged range list holds time `t`."""
    i = bisect.bisect_right(ranges, (t, float("inf"))) - 1
    return i >= 0 and ranges[i][0] <= t <= ranges[i][1]


def union_length(spans: Iterable[tuple[float, float]]) -> float:
    return sum(e - s for s, e in merge_intervals(spans))


def clip(
    spans: Iterable[tuple[float, float, str]], window: list[tuple[float, float]]
) -> list[tuple[float, float, str]]:
    """Labelled intervals cut to a merged window list (parts outside it dropped)."""
    out = []
    for start, end, label in spans:
        i = max(bisect.bisect_right(window, (start, float("inf"))) - 1, 0)
        while i < len(window) and window[i][0] < end:
            lo, hi = max(start, window[i][0]), min(end, window[i][1])
            if hi > lo:
                out.append((lo, hi, label))
            i += 1
    return out


def split_busy_time(spans: Iterable[tuple[float, float, str]]) -> dict[str, float]:
    """Busy time per label: at each instant the time is shared equally by the intervals running
    then, so the labels add up to the length of the union of all intervals (a sweep over their ends)."""
    points = []
    for start, end, label in spans:
        if end > start:
            points.append((start, 1, label))
            points.append((end, -1, label))
    points.sort(key=lambda p: (p[0], p[1]))
    active: dict[str, int] = defaultdict(int)
    total_active = 0
    shares: dict[str, float] = defaultdict(float)
    last = None
    for t, delta, label in points:
        if last is not None and total_active and t > last:
            dt = t - last
            for name, count in active.items():
                if count:
                    shares[name] += dt * count / total_active
        active[label] += delta
        total_active += delta
        last = t
    return dict(shares)
