"""Sampling math of the embedded server against plain per-row reference loops."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from asyncgrpo.server.sampling import (
    SamplingBatch,
    apply_repetition_penalty,
    hash_uniform,
    plan_columns,
    row_hash,
    sample,
    seed_hash,
    sortable_keys,
    token_hash,
)


def _batch(rows: list[dict], vocab: int, positions: list[int] | None = None, top_logprobs: int = 0,
           masks: bool = False) -> SamplingBatch:
    top_ks = [r.get("top_k", 0) for r in rows]
    top_ps = [r.get("top_p", 1.0) for r in rows]
    mask_width = max(top_ks) if masks else 0
    return SamplingBatch(
        temperature=torch.tensor([r.get("temperature", 1.0) for r in rows], dtype=torch.float32),
        top_k=torch.tensor(top_ks, dtype=torch.int64),
        top_p=torch.tensor(top_ps, dtype=torch.float32),
        min_p=torch.tensor([r.get("min_p", 0.0) for r in rows], dtype=torch.float32),
        row_hashes=row_hash(seed_hash(torch.tensor([r.get("seed", 0) for r in rows], dtype=torch.int64)),
                            torch.tensor(positions or [0] * len(rows), dtype=torch.int64)),
        num_sorted=plan_columns(top_ks, top_ps, top_logprobs, mask_width, vocab),
        num_top_logprobs=top_logprobs,
        mask_width=mask_width,
        all_top_k=all(k > 0 for k in top_ks),
        token_hashes=token_hash(torch.arange(vocab)),
    )


def _reference(row: torch.Tensor, temperature: float, top_k: int, top_p: float, min_p: float):
    """Plain loop: candidate ids and processed log-probs of one row (float64 after scaling)."""
    t = temperature if temperature > 0 else 1.0
    scaled = (row.float() / torch.tensor(t, dtype=torch.float32)).tolist()
    v = len(scaled)
    order = sorted(range(v), key=lambda j: (-scaled[j], j))
    top = scaled[order[0]]
    kept = [j for j in order if min_p == 0 or scaled[j] >= top + math.log(min_p)]
    if top_k > 0:
        kept = kept[:top_k]
    if top_p < 1.0:
        z = sum(math.exp(scaled[j] - top) for j in kept)
        mass, out = 0.0, []
        for j in kept:
            if mass < top_p:
                out.append(j)
            mass += math.exp(scaled[j] - top) / z
        kept = out
    z = math.log(sum(math.exp(scaled[j] - top) for j in kept)) + top
    logprobs = [scaled[j] - z if j in set(kept) else -math.inf for j in range(v)]
    return kept, logprobs, order


ROWS = [
    {"temperature": 1.0, "top_k": 5, "seed": 1},
    {"temperature": 0.7, "top_k": 12, "top_p": 0.8, "seed": 2},
    {"temperature": 1.3, "top_k": 30, "min_p": 0.05, "seed": 3},
    {"temperature": 0.0, "top_k": 3, "seed": 4},
    {"temperature": 1.0, "top_k": 8, "top_p": 0.5, "min_p": 0.1, "seed": 5},
]


@pytest.mark.parametrize("extra", [None, {"temperature": 0.9, "seed": 9}, {"top_p": 0.9, "seed": 9}])
def test_candidates_logprobs_and_ranks_match_plain_loop(extra):
    """Every path (partial sort, no-sort rows, full sort) gives the reference sets and values."""
    torch.manual_seed(0)
    vocab = 64
    rows = ROWS + ([extra] if extra else [])
    logits = torch.randn(len(rows), vocab) * 3
    out = sample(logits, _batch(rows, vocab, top_logprobs=6, masks=True))
    for i, r in enumerate(rows):
        kept, ref_lp, order = _reference(logits[i], r.get("temperature", 1.0), r.get("top_k", 0),
                                         r.get("top_p", 1.0), r.get("min_p", 0.0))
        assert int(out.num_candidates[i]) == len(kept)
        tok = int(out.token_ids[i])
        assert tok in kept
        assert out.logprobs[i].item() == pytest.approx(ref_lp[tok], abs=1e-5)
        assert int(out.ranks[i]) == sum(1 for x in ref_lp if x >= ref_lp[tok] - 1e-7)
        assert out.top_ids[i].tolist() == order[:6]
        for j, lp in zip(out.top_ids[i].tolist(), out.top_logprobs[i].tolist()):
            assert (lp == -math.inf and ref_lp[j] == -math.inf) or lp == pytest.approx(ref_lp[j], abs=1e-5)
        if r.get("top_k", 0) > 0:
            mask = [x for x in out.mask_ids[i].tolist() if x >= 0]
            assert mask == sorted(kept)
        if r.get("temperature", 1.0) == 0:
            assert tok == order[0]


def test_ties_keep_exactly_k_with_the_lowest_ids():
    vocab = 40
    logits = torch.zeros(1, vocab)
    logits[0, [3, 7, 11, 20, 33]] = 2.0  # five tied best tokens
    out = sample(logits, _batch([{"top_k": 3, "seed": 1}], vocab, top_logprobs=4, masks=True))
    assert out.mask_ids[0].tolist() == [3, 7, 11]
    assert out.top_ids[0].tolist() == [3, 7, 11, 20]
    assert out.top_logprobs[0, 3].item() == -math.inf
    assert out.logprobs[0].item() == pytest.approx(-math.log(3), abs=1e-6)
    # rank counts every token at least as likely as the sampled one
    assert int(out.ranks[0]) == 3


def test_greedy_picks_lowest_id_among_ties_and_ignores_seed():
    logits = torch.tensor([[0.0, 5.0, 1.0, 5.0]])
    for seed in range(5):
        out = sample(logits, _batch([{"temperature": 0.0, "seed": seed}], 4))
        assert int(out.token_ids[0]) == 1


def test_same_seed_same_tokens_regardless_of_batch_and_path():
    torch.manual_seed(1)
    vocab = 50
    row = torch.randn(1, vocab)
    params = {"temperature": 1.0, "top_k": 10, "top_p": 0.95, "seed": 1234}
    others = torch.randn(3, vocab)
    for pos in range(20):
        alone = sample(row, _batch([params], vocab, positions=[pos]))
        # other rows force the full-vocabulary path (top_k off, top_p < 1) and change the batch
        mixed_rows = [{"top_p": 0.7, "seed": 7}, params, {"temperature": 0.5, "seed": 8},
                      {"top_k": 3, "seed": 9}]
        logits = torch.cat([others[:1], row, others[1:]])
        mixed = sample(logits, _batch(mixed_rows, vocab, positions=[3, pos, 5, 6]))
        assert int(alone.token_ids[0]) == int(mixed.token_ids[1])
        assert alone.logprobs[0].item() == pytest.approx(mixed.logprobs[1].item(), abs=1e-6)


def test_different_seeds_and_positions_draw_differently():
    vocab = 100
    logits = torch.zeros(1, vocab)
    by_seed = {int(sample(logits, _batch([{"seed": s}], vocab)).token_ids[0]) for s in range(30)}
    by_pos = {int(sample(logits, _batch([{"seed": 0}], vocab, positions=[p])).token_ids[0])
              for p in range(30)}
    assert len(by_seed) > 15 and len(by_pos) > 15


def test_draws_follow_the_processed_distribution():
    """Frequencies over many seeds match the candidate probabilities (seeded Gumbel-max is exact)."""
    vocab = 6
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0]])
    n = 20000
    rows = [{"temperature": 0.8, "top_k": 4, "seed": s} for s in range(n)]
    out = sample(logits.expand(n, vocab).contiguous(), _batch(rows, vocab))
    counts = torch.bincount(out.token_ids, minlength=vocab).double() / n
    _, ref_lp, _ = _reference(logits[0], 0.8, 4, 1.0, 0.0)
    expected = torch.tensor([math.exp(x) for x in ref_lp], dtype=torch.float64)
    assert counts[4:].sum() == 0
    assert torch.allclose(counts, expected, atol=0.015), (counts, expected)


def test_hash_uniform_is_deterministic_uniform_and_input_sensitive():
    seeds = torch.tensor([0, 1, -5, 2**40 + 3], dtype=torch.int64)
    pos = torch.tensor([0, 0, 7, 123456], dtype=torch.int64)
    ids = torch.arange(5000)
    u = hash_uniform(seeds, pos, ids)
    assert torch.equal(u, hash_uniform(seeds, pos, ids))
    assert u.min() > 0 and u.max() < 1
    assert abs(u.mean().item() - 0.5) < 0.01
    assert abs(u.var().item() - 1 / 12) < 0.005
    # distinct rows are not copies of each other, and neighbouring ids are uncorrelated
    assert (u[0] != u[1]).float().mean() > 0.99
    corr = torch.corrcoef(torch.stack([u[0, :-1], u[0, 1:]]))[0, 1]
    assert abs(corr.item()) < 0.05
    # only the low 64 bits of the seed matter and the high half counts
    hi = hash_uniform(torch.tensor([3 + (1 << 32)]), torch.tensor([0]), ids)
    lo = hash_uniform(torch.tensor([3]), torch.tensor([0]), ids)
    assert not torch.equal(hi, lo)


def test_sortable_keys_order_matches_value_desc_then_id_asc():
    values = torch.tensor([[0.0, -0.0, 1.5, -2.0, float("-inf"), 1.5, 3e-39, -3e-39, 7.0, -7.0]])
    keys = sortable_keys(values)
    got = keys.argsort(dim=-1, descending=True)[0].tolist()
    ref = sorted(range(values.shape[1]), key=lambda j: (-values[0, j].item(), j))
    # +0.0 and -0.0 compare equal as floats; the keys put +0.0 first, which is also lowest id here
    assert got == ref


def test_repetition_penalty_matches_plain_rule():
    logits = torch.tensor([[2.0, -2.0, 1.0, -1.0]])
    seen = torch.tensor([[True, True, False, False]])
    out = apply_repetition_penalty(logits, seen, torch.tensor([2.0]))
    assert out.tolist() == [[1.0, -4.0, 1.0, -1.0]]


def test_plan_columns():
    assert plan_columns([0, 0], [1.0, 1.0], 5, 0, 100) == 0
    assert plan_columns([20, 0], [1.0, 1.0], 5, 20, 100) == 20
    assert plan_columns([20, 4], [1.0, 0.9], 30, 20, 100) == 30
    assert plan_columns([20, 0], [1.0, 0.9], 5, 20, 100) == 100
    assert plan_columns([500], [1.0], 0, 0, 100) == 100


def test_seed_and_row_hashes_are_the_same_on_numpy_and_torch():
    """The server hashes seeds and positions on the host (numpy) and draws on the device."""
    seeds = [0, 1, -5, 2**40 + 3, -(2**63), 2**63 - 1]
    host = seed_hash(np.array(seeds, dtype=np.int64))
    device = seed_hash(torch.tensor(seeds, dtype=torch.int64))
    assert host.tolist() == device.tolist()
    assert token_hash(np.arange(50)).tolist() == token_hash(torch.arange(50)).tolist()
    positions = [0, 3, 7, 2**33, 5, 1]
    assert (row_hash(host, np.array(positions)).tolist()
            == row_hash(device, torch.tensor(positions)).tolist())
