"""bench/weight_deltas.py's counting against a plain count: which bf16 words changed and what a delta push
of them costs."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

from weight_deltas import compare, push_bytes, served


def test_push_bytes_takes_the_cheaper_encoding():
    assert push_bytes(0, 1000) == 0
    assert push_bytes(10, 1000) == 60  # indices + values: 10 * 6 < 125 + 20
    assert push_bytes(500, 1000) == 125 + 1000  # bitmask + values


def test_compare_counts_changed_bf16_words():
    model = torch.nn.Linear(64, 32, bias=True)
    before = served(model)
    with torch.no_grad():
        model.weight[0, :5] += 1.0  # changes the bf16 word
        model.weight[1, :7] += 1e-7 * model.weight[1, :7].abs()  # below bf16's spacing: unchanged
        model.bias[3] = -model.bias[3] + 0.5
    after = served(model)
    plain = sum(
        float(a) != float(b)
        for k in before
        for a, b in zip(before[k].flatten().tolist(), after[k].flatten().tolist())
    )
    result = compare(before, after)
    words = 64 * 32 + 32
    assert plain == 6
    assert result["changed_fraction"] == plain / words
    assert result["full_bytes"] == words * 2
    assert result["delta_bytes"] == 5 * 6 + 1 * 6
    assert result["sent_bytes"] == result["delta_bytes"]  # what weight_push="delta" sends: the same forms
