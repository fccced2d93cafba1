"""Tree packing layout: the seed's worked example, losslessness, sharing and per-token data."""

from __future__ import annotations

import pickle
import time

import numpy as np
import pytest
import torch

from asyncgrpo.packing import Sample, pack_row, sample_paths, unpack_token_ids
from asyncgrpo.packing.attention import TreeMask


def make_sample(tokens, num_context, group=0, advantage=1.0, **kwargs) -> Sample:
    mask = [i >= num_context for i in range(len(tokens))]
    logprobs = [-0.1 * (i + 1) if m else 0.0 for i, m in enumerate(mask)]
    return Sample(list(tokens), mask, logprobs, advantage, group, **kwargs)


def random_samples(rng: np.random.Generator, num: int, vocab: int = 4) -> list[Sample]:
    """Small vocabulary: many shared prefixes, prefixes of others, duplicates."""
    bases = [list(rng.integers(0, vocab, int(rng.integers(1, 7)))) for _ in range(3)]
    samples = []
    for _ in range(num):
        base = bases[int(rng.integers(0, 3))]
        tokens = (base[: int(rng.integers(0, len(base) + 1))]
                  + list(rng.integers(0, vocab, int(rng.integers(0, 5)))))
        tokens = tokens or [0]
        samples.append(make_sample(tokens, int(rng.integers(1, len(tokens) + 1)),
                                   group=int(rng.integers(0, 3))))
    return samples


def test_seed_worked_example():
    p1, p2, p3, a1, a2, b1, b2 = 11, 12, 13, 40, 41, 20, 21  # b1 < a1: order follows the rollouts, not ids
    r0 = make_sample([p1, p2, p3, a1, a2], 3)
    r1 = make_sample([p1, p2, p3, b1, b2], 3)
    row = pack_row([r0, r1])
    assert row.input_ids.tolist() == [p1, p2, p3, a1, a2, p3, b1, b2]
    assert row.position_ids.tolist() == [0, 1, 2, 3, 4, 2, 3, 4]
    assert row.segment_ids.tolist() == [0, 0, 1, 1, 1, 2, 2, 2]
    assert row.segment_parent.tolist() == [-1, 0, 0]
    assert row.segment_start.tolist() == [0, 2, 5] and row.segment_len.tolist() == [2, 3, 3]
    assert row.pred_index.tolist() == [2, 3, 5, 6]
    assert row.target_ids.tolist() == [a1, a2, b1, b2]
    assert row.sample_index.tolist() == [0, 0, 1, 1]
    assert row.num_tokens == 8 and row.num_raw_tokens == 10
    # attention: each segment sees its root-to-segment path (seed step 4)
    visible = TreeMask.from_row(row).dense()
    assert [torch.nonzero(visible[i]).flatten().tolist() for i in (1, 4, 7)] == [[0, 1], [0, 1, 2, 3, 4],
                                                                                   [0, 1, 5, 6, 7]]


@pytest.mark.parametrize("seed", range(40))
def test_row_is_lossless_and_each_position_predicts_one_token(seed):
    rng = np.random.default_rng(seed)
    samples = random_samples(rng, int(rng.integers(1, 12)))
    row = pack_row(samples)
    for sample, tokens, path in zip(samples, unpack_token_ids(row), sample_paths(row)):
        np.testing.assert_array_equal(tokens, sample.token_ids)
        np.testing.assert_array_equal(row.position_ids.numpy()[path], np.arange(sample.num_tokens))
    next_token: dict[int, int] = {}
    for sample, path in zip(samples, sample_paths(row)):
        for depth in range(sample.num_tokens - 1):
            assert next_token.setdefault(int(path[depth]),
                                         int(sample.token_ids[depth + 1])) == sample.token_ids[depth + 1]
    # every trained token kept, predicted by the previous token of its own sample
    assert row.num_trained == sum(s.num_trained for s in samples)
    for n in range(row.num_trained):
        sample = samples[int(row.sample_index[n])]
        path = sample_paths(row)[int(row.sample_index[n])]
        depth = int(np.flatnonzero(path == int(row.pred_index[n]))[0])
        assert sample.trained_mask[depth + 1] and sample.token_ids[depth + 1] == int(row.target_ids[n])


@pytest.mark.parametrize("seed", range(15))
def test_each_token_sees_exactly_its_own_prefix(seed):
    """The attention rule from the row equals each sample's own causal attention."""
    samples = random_samples(np.random.default_rng(100 + seed), 8)
    row = pack_row(samples)
    visible = TreeMask.from_row(row).dense()
    for path in sample_paths(row):
        for depth, index in enumerate(path):
            assert torch.nonzero(visible[index]).flatten().tolist() == sorted(path[: depth + 1].tolist())


def test_group_shares_prompt_minus_the_forking_token():
    prompt = list(range(1, 9))
    completions = [[20 + g, 30, 31, 32][: 2 + g] for g in range(4)]  # distinct first completion tokens
    row = pack_row([make_sample(prompt + c, len(prompt)) for c in completions])
    assert row.num_tokens == (len(prompt) - 1) + sum(len(c) + 1 for c in completions)


def test_shared_system_prompt_across_groups_and_multi_turn_fork():
    system = [7, 7, 7, 7]
    turn1 = system + [1, 2, 50, 51]
    turn2 = turn1 + [3, 52, 53]  # the second turn starts with the whole first sample
    other_group = system + [9, 9, 60]
    row = pack_row([make_sample(turn1, 6, group=0), make_sample(turn2, 9, group=0),
                    make_sample(other_group, 6, group=1)])
    # turn2 shares all of turn1; the other group shares the system prompt minus its last token
    assert row.num_tokens == len(turn2) + (len(other_group) - (len(system) - 1))
    assert row.group_ids == (0, 0, 1)


def test_duplicates_keep_their_trained_tokens_at_the_same_positions():
    a = make_sample([1, 2, 3, 4, 5], 2, advantage=1.0)
    b = make_sample([1, 2, 3, 4, 5], 2, advantage=-2.0)
    row = pack_row([a, b])
    assert row.num_tokens == 5
    assert row.pred_index.tolist() == [1, 2, 3, 1, 2, 3]
    assert row.advantages.tolist() == [1.0, 1.0, 1.0, -2.0, -2.0, -2.0]
    assert row.sample_index.tolist() == [0, 0, 0, 1, 1, 1]


def test_nothing_shared_is_plain_packing_in_input_order():
    samples = [make_sample([9, 1, 2], 1), make_sample([3, 4], 1), make_sample([5, 6, 7, 8], 2)]
    row = pack_row(samples)
    assert row.input_ids.tolist() == [9, 1, 2, 3, 4, 5, 6, 7, 8]
    assert row.position_ids.tolist() == [0, 1, 2, 0, 1, 0, 1, 2, 3]
    assert row.segment_parent.tolist() == [-1, -1, -1]


def test_without_sharing_every_sample_is_its_own_root():
    samples = [make_sample([1, 2, 3], 1), make_sample([1, 2, 4], 1), make_sample([1, 2, 3], 1)]
    row = pack_row(samples, share_prefixes=False)
    assert row.input_ids.tolist() == [1, 2, 3, 1, 2, 4, 1, 2, 3]
    assert row.segment_parent.tolist() == [-1, -1, -1] and row.pred_index.tolist() == [0, 1, 3, 4, 6, 7]


def test_per_token_sampler_data_follows_its_token():
    topk_a = [None, None, ((5, -0.1), (6, -2.0)), ((7, -0.3),)]
    cands_a = [None, None, (5, 6), (2, 7, 9)]
    a = make_sample([1, 2, 5, 7], 2, sampler_topk=topk_a, candidate_sets=cands_a)
    b = make_sample([1, 2, 6], 2)  # no top-K, no candidates: padded / empty ranges
    c = make_sample([1, 3, 8], 2, sampler_topk=[None, None, {8: -0.5, 1: -1.5, 2: -3.0}])
    row = pack_row([a, b, c])
    assert row.target_ids.tolist() == [5, 7, 6, 8]
    assert row.sampler_topk_ids.tolist() == [[5, 6, -1], [7, -1, -1], [-1, -1, -1], [8, 1, 2]]
    assert row.sampler_topk_logprobs[0, :2].tolist() == pytest.approx([-0.1, -2.0])
    assert (torch.isinf(row.sampler_topk_logprobs[2]).all()
            and row.sampler_topk_logprobs[3, 2].item() == pytest.approx(-3.0))
    off = row.candidate_offsets.tolist()
    ids = row.candidate_ids.tolist()
    assert [ids[off[n]:off[n + 1]] for n in range(4)] == [[5, 6], [2, 7, 9], [], []]
    assert row.sampler_logprobs.tolist() == pytest.approx([-0.3, -0.4, -0.3, -0.3])


def test_sample_pickles_and_rejects_a_trained_first_token():
    s = make_sample([1, 2, 3], 1, sampler_topk=[None, ((2, -0.5),), None], model_version=3, rollout_id="r")
    t = pickle.loads(pickle.dumps(s))
    np.testing.assert_array_equal(t.token_ids, s.token_ids)
    np.testing.assert_array_equal(t.sampler_topk_ids, s.sampler_topk_ids)
    assert (t.model_version, t.rollout_id, t.num_trained) == (3, "r", 2)
    with pytest.raises(ValueError, match="trained_mask\\[0\\]"):
        Sample([1, 2], [True, True], [0.0, 0.0], 1.0, 0)
    with pytest.raises(ValueError, match="one entry per token"):
        Sample([1, 2], [False, True], [0.0], 1.0, 0)


def test_packing_100_samples_of_2k_tokens_is_fast():
    rng = np.random.default_rng(0)
    samples = []
    for group in range(12):
        prompt = rng.integers(0, 150_000, 512)
        for _ in range(8):
            completion = rng.integers(0, 150_000, int(rng.integers(256, 2048)))
            tokens = np.concatenate([prompt, completion])
            mask = np.arange(tokens.size) >= prompt.size
            samples.append(Sample(tokens, mask, np.where(mask, -0.5, 0.0), 1.0, group))
    pack_row(samples)  # warm-up
    start = time.perf_counter()
    row = pack_row(samples)
    elapsed = time.perf_counter() - start
    assert row.num_tokens == sum(s.num_tokens for s in samples) - 12 * 7 * 511
    assert elapsed < 0.5, f"pack_row took {elapsed:.3f}s for 96 samples"


def test_samples_of_one_completion_share_a_completion_index():
    # a multi-turn rollout that forked gives two samples with the same rollout id: the clip_ratio
    # extremes are per completion, so both map to one index
    samples = [
        Sample([1, 2, 3, 4], [0, 0, 1, 1], [0, 0, -1, -1], 1.0, 0, rollout_id="r0"),
        Sample([1, 2, 5, 6, 7], [0, 0, 0, 1, 1], [0, 0, 0, -1, -1], 1.0, 0, rollout_id="r1"),
        Sample([1, 2, 3, 9, 8], [0, 0, 0, 0, 1], [0, 0, 0, 0, -1], 1.0, 0, rollout_id="r0"),
        Sample([1, 2, 3, 4], [0, 0, 1, 1], [0, 0, -1, -1], 1.0, 0),  # no id: a completion of its own
    ]
    row = pack_row(samples)
    by_sample = {int(s): int(c) for s, c in zip(row.sample_index, row.completion_index)}
    assert by_sample[0] == by_sample[2]
    assert len({by_sample[0], by_sample[1], by_sample[3]}) == 3


def test_a_trained_token_outside_its_own_candidate_set_is_rejected():
    # the sampler could not have drawn it: the turn's output_sampling_mask and output_ids disagree
    with pytest.raises(ValueError, match=r"token 4 at position 3 is not in its candidate set"):
        Sample([1, 2, 3, 4], [0, 0, 1, 1], [0, 0, -1, -1], 1.0, 0,
               candidate_sets=[None, None, [3, 5], [6, 7]])
    # an untrained (context) token is not checked, and None means the full vocabulary
    Sample([1, 2, 3, 4], [0, 0, 0, 1], [0, 0, 0, -1], 1.0, 0, candidate_sets=[None, None, [5], None])
