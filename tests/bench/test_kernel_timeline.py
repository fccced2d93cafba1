"""Tests for bench/kernel_timeline.py: busy time split over concurrent kernels against a brute-force
per-tick count, and the trace parsing the profile summary relies on."""

from __future__ import annotations

import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from kernel_timeline import (  # bench/ is not a package: imported from its path
    clip,
    contains,
    device_kernels,
    merge_intervals,
    outermost_host_ops,
    split_busy_time,
    union_length,
)


def _brute_force_shares(spans, ticks):
    """Integer-tick timeline: each busy tick shared equally by the intervals covering it."""
    shares, busy = {}, 0
    for t in range(ticks):
        active = [label for start, end, label in spans if start <= t < end]
        busy += bool(active)
        for label in active:
            shares[label] = shares.get(label, 0.0) + 1 / len(active)
    return shares, busy


def test_busy_time_split_matches_brute_force_and_adds_up_to_the_union():
    rng = random.Random(0)
    for _ in range(50):
        spans = []
        for _ in range(rng.randint(1, 12)):
            start = rng.randint(0, 90)
            spans.append((start, start + rng.randint(0, 15), rng.choice("abc")))
        want, busy = _brute_force_shares(spans, 120)
        got = split_busy_time(spans)
        assert set(got) <= set(want) | {label for s, e, label in spans if e == s}
        for label, value in want.items():
            assert abs(got.get(label, 0.0) - value) < 1e-9
        assert abs(sum(got.values()) - busy) < 1e-9
        assert union_length((s, e) for s, e, _ in spans) == busy


def test_clip_and_contains_follow_the_window():
    window = merge_intervals([(10, 20), (15, 30), (40, 50)])
    assert window == [(10, 30), (40, 50)]
    assert clip([(0, 45, "k"), (31, 39, "gap")], window) == [(10, 30, "k"), (40, 45, "k")]
    assert (contains(window, 10) and contains(window, 30) and not contains(window, 35)
            and not contains(window, 5))


def test_kernels_take_their_launch_time_and_cpu_ops_only_the_outermost():
    events = [
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 5, "dur": 1,
         "args": {"correlation": 7}},
        {"ph": "X", "cat": "kernel", "name": "gemm", "ts": 100, "dur": 10, "args": {"correlation": 7}},
        {"ph": "X", "cat": "gpu_memset", "name": "Memset", "ts": 120, "dur": 2, "args": {}},
        {"ph": "X", "cat": "cpu_op", "name": "aten::linear", "ts": 0, "dur": 10, "tid": 1},
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 2, "dur": 5, "tid": 1},
        {"ph": "X", "cat": "cpu_op", "name": "aten::mul", "ts": 3, "dur": 2, "tid": 2},
    ]
    gemm, memset = device_kernels(events)
    assert (gemm.name, gemm.start, gemm.end, gemm.launch) == ("gemm", 100, 110, 5)
    assert memset.launch == memset.start == 120
    assert sorted(k.name for k in outermost_host_ops(events)) == ["aten::linear", "aten::mul"]
