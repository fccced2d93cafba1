"""TokenBudgetBatcher: budget, non-empty rows, group affinity, spill rule, drops, exactly-once."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from asyncgrpo.packing import Sample, TokenBudgetBatcher, pack_row


def sample(tokens, group, num_context=1) -> Sample:
    mask = [i >= num_context for i in range(len(tokens))]
    return Sample(list(tokens), mask, [0.0] * len(tokens), 1.0, group)


def distinct(length: int, group: int, first: int) -> Sample:
    """A sample sharing nothing with others that start with a different `first` token."""
    return sample([first] + [1000 + group] * (length - 1), group)


def test_rows_respect_budget_and_match_pack_row_counts():
    rng = np.random.default_rng(0)
    batcher = TokenBudgetBatcher(token_budget=120, num_processes=3)
    batches = []
    for group in range(40):
        prompt = list(rng.integers(0, 50, int(rng.integers(5, 30))))
        for _ in range(4):
            batches += batcher.add(sample(prompt + list(rng.integers(0, 50, int(rng.integers(1, 40)))), group,
                                          len(prompt)))
    assert batches
    for batch in batches:
        assert len(batch.rows) == 3 and all(batch.rows)
        for row_samples, tokens, cost, trained in zip(batch.rows, batch.row_tokens, batch.row_costs,
                                                      batch.row_trained_tokens):
            packed = pack_row(row_samples)
            assert tokens == packed.num_tokens <= 120
            assert cost == packed.attention_pairs
            assert trained == packed.num_trained <= 120
        metrics = batch.metrics()
        assert (metrics["batch/packing_ratio"]
                == pytest.approx(sum(batch.row_raw_tokens) / sum(batch.row_tokens)))
        assert metrics["batch/packing_ratio"] > 1.0
        assert 0.0 <= metrics["batch/pad_frac"] < 1.0 and metrics["batch/row_imbalance"] >= 1.0
        assert metrics["batch/row_tokens_max"] == max(batch.row_tokens)


def test_every_sample_emitted_exactly_once_or_dropped():
    rng = np.random.default_rng(1)
    batcher = TokenBudgetBatcher(token_budget=64, num_processes=2)
    sent, emitted, dropped = [], [], 0
    for i in range(300):
        s = sample(list(rng.integers(0, 5, int(rng.integers(2, 80)))), group=int(rng.integers(0, 30)))
        sent.append(s)
        for batch in batcher.add(s):
            emitted += [x for row in batch.rows for x in row]
            dropped += batch.dropped_oversize_count
    for batch in batcher.flush():
        emitted += [x for row in batch.rows for x in row]
        dropped += batch.dropped_oversize_count
    oversize = [s for s in sent if s.num_tokens > 64]
    assert batcher.num_dropped_oversize == len(oversize) > 0
    assert dropped <= len(oversize)  # the rest is reported with the next micro-batch
    assert batcher.num_pending_samples < 2  # flush keeps only what cannot fill one row per process
    kept = emitted + batcher.pending_samples
    assert sorted(map(id, kept)) == sorted(id(s) for s in sent if s.num_tokens <= 64)


def test_group_stays_in_its_row():
    batcher = TokenBudgetBatcher(token_budget=1000, num_processes=2)
    prompts = {g: [g + 1] * 10 for g in range(4)}
    for i in range(3):
        for g in range(4):
            assert batcher.add(sample(prompts[g] + [100 + i, 7], g, 10)) == []
    (batch,) = batcher.flush()
    for row in batch.rows:
        groups = {s.group_id for s in row}
        assert len(groups) == 2 and all(sum(s.group_id == g for s in row) == 3 for g in groups)


def test_oversize_sample_is_dropped_warned_and_counted(caplog):
    batcher = TokenBudgetBatcher(token_budget=10, num_processes=1)
    with caplog.at_level(logging.WARNING):
        assert batcher.add(distinct(11, group=5, first=1)) == []
    assert "over token_budget=10" in caplog.text and "group 5" in caplog.text
    batcher.add(distinct(4, group=0, first=2))
    (batch,) = batcher.flush()
    assert batch.dropped_oversize_count == 1 and batch.metrics()["batch/dropped_oversize_count"] == 1.0
    assert batcher.num_dropped_oversize == 1


def test_loss_terms_are_bounded_even_when_tokens_are_shared():
    batcher = TokenBudgetBatcher(token_budget=10, num_processes=1, max_trained_tokens=8)
    s = sample([1, 2, 3, 4, 5], 0)  # 4 trained tokens each; duplicates share all 5 tokens
    assert batcher.add(s) == [] and batcher.add(sample([1, 2, 3, 4, 5], 0)) == []
    (closed,) = batcher.add(sample([1, 2, 3, 4, 5], 0))  # 12 trained > 8: the micro-batch closes
    assert closed.row_tokens == [5] and closed.row_trained_tokens == [8]


def test_full_group_row_spills_into_an_empty_row():
    batcher = TokenBudgetBatcher(token_budget=20, num_processes=2)
    prompt = list(range(1, 9))
    assert batcher.add(sample(prompt + [50, 51, 52, 53], 0, 8)) == []  # 12 tokens
    assert batcher.add(sample(prompt + [60, 61, 62, 63], 0, 8)) == []  # +5 = 17 tokens
    assert batcher.add(sample(prompt + [70, 71, 72, 73, 74, 75], 0, 8)) == []  # +7 > 20: row 1 is empty
    (batch,) = batcher.flush()
    assert [len(r) for r in batch.rows] == [2, 1] and batch.row_tokens == [17, 14]


def test_spill_allowed_when_it_does_not_raise_the_most_loaded_row():
    batcher = TokenBudgetBatcher(token_budget=20, num_processes=2)
    batcher.add(distinct(4, group=0, first=1))  # row 0, cost 10
    batcher.add(distinct(18, group=1, first=2))  # row 1 (cheaper), cost 171
    assert batcher.add(distinct(4, group=1, first=3)) == []  # row 1 full: spill to row 0, cost 20 <= 171
    (batch,) = batcher.flush()
    assert [[s.group_id for s in r] for r in batch.rows] == [[0, 1], [1]]


def test_micro_batch_closes_when_a_spill_would_raise_the_most_loaded_row():
    batcher = TokenBudgetBatcher(token_budget=20, num_processes=2)
    batcher.add(distinct(10, group=0, first=1))  # row 0, cost 55
    for i in range(6):
        assert batcher.add(distinct(3, group=1, first=10 + i)) == []  # row 1: 18 tokens, cost 36
    (closed,) = batcher.add(distinct(3, group=1, first=30))  # row 0 would cost 61 > 55
    assert closed.row_tokens == [10, 18] and closed.row_costs == [55, 36]
    assert batcher.num_pending_samples == 1


def test_flush_with_fewer_samples_than_processes_waits_and_splits_otherwise():
    batcher = TokenBudgetBatcher(token_budget=100, num_processes=3)
    prompt = [5] * 6
    batcher.add(sample(prompt + [1, 1], 0, 6))
    batcher.add(sample(prompt + [2, 2], 0, 6))
    assert batcher.flush() == [] and batcher.num_pending_samples == 2  # 2 samples, 3 processes: wait
    batcher.add(sample(prompt + [3, 3], 0, 6))  # same group: all three in row 0
    (batch,) = batcher.flush()
    assert [len(r) for r in batch.rows] == [1, 1, 1]
    assert batch.row_tokens == [8, 8, 8] and batcher.num_pending_samples == 0


def test_invalid_settings_name_the_field():
    with pytest.raises(ValueError, match="token_budget"):
        TokenBudgetBatcher(token_budget=0, num_processes=1)
    with pytest.raises(ValueError, match="num_processes"):
        TokenBudgetBatcher(token_budget=10, num_processes=0)
