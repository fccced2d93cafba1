"""The chunked delta rule over a forest of segments (modeling/deltanet/delta_rule.py) against the plain
token recurrence along each segment's root-to-segment path, in float64: outputs, final states, gradients."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

# the delta-rule reference of tests/packing/test_recurrent.py
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "packing"))
from test_recurrent import l2, plain_delta_rule, random_inputs

from asyncgrpo.modeling.deltanet.delta_rule import (
    ChunkPlan,
    chunk_gated_delta_rule,
    segment_tree_delta_rule,
    unit_lower_inverse,
)

# (parent, length) in depth-first order, for chunks of 4: a root of chunk + 1 tokens; under it a chain
# of one-token segments ending in a long one, a child of exactly one chunk with its own child, and a
# one-token sibling (siblings of 1, 4 and 23 tokens at one depth); a one-token root with a child; a
# childless root of several chunks.
FOREST = [(-1, 5), (0, 1), (1, 1), (2, 23), (0, 4), (4, 3), (0, 1), (-1, 1), (7, 9), (-1, 12)]


def forest_arrays(forest):
    parent = np.array([p for p, _ in forest], dtype=np.int64)
    length = np.array([n for _, n in forest], dtype=np.int64)
    start = np.concatenate([[0], np.cumsum(length)[:-1]])
    return parent, start, length


def segment_path(segment, parent, start, length) -> np.ndarray:
    """Packed indices of the tokens from the segment's root to its end."""
    pieces = []
    while segment >= 0:
        pieces.append(np.arange(start[segment], start[segment] + length[segment]))
        segment = parent[segment]
    return np.concatenate(pieces[::-1])


def normalized(q, k):
    return l2(q) * q.shape[-1] ** -0.5, l2(k)


def plain_forest(q, k, v, g, beta, forest, initial):
    """Per segment: the plain recurrence along its path from its root's initial state; (its own
    outputs, its final state). q/k already normalised, repeated to the value heads."""
    parent, start, length = forest_arrays(forest)
    roots = list(np.flatnonzero(parent < 0))
    results = []
    for s in range(len(forest)):
        path = torch.as_tensor(segment_path(s, parent, start, length))
        root = s
        while parent[root] >= 0:
            root = parent[root]
        state = None if initial is None else initial[roots.index(root)]
        out, final = plain_delta_rule(q[path], k[path], v[path], g[path], beta[path], state, normalize=False)
        results.append((out[-length[s]:], final))
    return results


def realistic_system(size, batch=3, seed=0):
    """The WY system of a chunk as the delta rule builds it (beta k_i . k_j decay_ij)."""
    _, k, _, g, beta = random_inputs(size * batch, heads=1, dim_k=8, seed=seed)
    k = l2(k[:, 0]).view(batch, size, -1)
    cum = g[:, 0].view(batch, size).cumsum(-1)
    decay = (cum[..., :, None] - cum[..., None, :]).clamp(max=0).exp()
    return (k @ k.transpose(-1, -2)) * decay * beta[:, 0].view(batch, size, 1)


@pytest.mark.parametrize("size", [1, 2, 3, 5, 16, 64])
def test_unit_lower_inverse_equals_the_triangular_solve_and_reads_only_the_strict_lower_triangle(size):
    a = realistic_system(size)
    unit = torch.eye(size, dtype=a.dtype) + a.tril(-1)
    want = torch.linalg.solve_triangular(unit, torch.eye(size, dtype=a.dtype).expand_as(unit), upper=False)
    got = unit_lower_inverse(a + torch.randn_like(a).triu())  # diagonal and upper triangle: ignored
    torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-10)
    torch.testing.assert_close(got @ unit, torch.eye(size, dtype=a.dtype).expand_as(unit), atol=1e-12, rtol=0)


def test_unit_lower_inverse_gradients():
    a = realistic_system(6).requires_grad_()
    assert torch.autograd.gradcheck(unit_lower_inverse, (a,))


@pytest.mark.parametrize("chunk_size", [4, 64])
@pytest.mark.parametrize("key_heads", [2, 1])
def test_each_segment_continues_its_parents_final_state(chunk_size, key_heads):
    parent, start, length = forest_arrays(FOREST)
    plan = ChunkPlan.build(parent, start, length, chunk_size)
    q, k, v, g, beta = random_inputs(int(length.sum()), heads=2, key_heads=key_heads, seed=1)
    q, k = normalized(q, k)
    gen = torch.Generator().manual_seed(2)
    initial = torch.randn(3, 2, 4, 3, generator=gen, dtype=torch.float64)
    out, final = segment_tree_delta_rule(q, k, v, g, beta, plan, initial, output_final_state=True)
    assert out.shape == v.shape and final.shape == (len(FOREST), 2, 4, 3)
    repeated = [x.repeat_interleave(2 // key_heads, dim=1) for x in (q, k)]
    for s, (want_out, want_final) in enumerate(plain_forest(*repeated, v, g, beta, FOREST, initial)):
        tokens = slice(start[s], start[s] + length[s])
        torch.testing.assert_close(out[tokens], want_out, atol=1e-12, rtol=1e-10)
        torch.testing.assert_close(final[s], want_final, atol=1e-12, rtol=1e-10)


def test_roots_start_from_zeros_without_initial_states():
    forest = [(-1, 9), (0, 1), (0, 17), (-1, 4)]
    parent, start, length = forest_arrays(forest)
    q, k, v, g, beta = random_inputs(int(length.sum()), seed=3)
    q, k = normalized(q, k)
    out, final = segment_tree_delta_rule(q, k, v, g, beta, ChunkPlan.build(parent, start, length, 4))
    assert final is None
    for s, (want, _) in enumerate(plain_forest(q, k, v, g, beta, forest, None)):
        torch.testing.assert_close(out[start[s]: start[s] + length[s]], want, atol=1e-12, rtol=1e-10)


def test_forest_gradients_equal_the_plain_recurrence():
    parent, start, length = forest_arrays(FOREST)
    plan = ChunkPlan.build(parent, start, length, 4)
    raw = random_inputs(int(length.sum()), seed=4)
    initial = torch.randn(3, 2, 4, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    inputs = [x.requires_grad_() for x in (*raw, initial)]
    weight = torch.randn(int(length.sum()), 2, 3, dtype=torch.float64)
    final_weight = torch.randn(len(FOREST), 2, 4, 3, dtype=torch.float64)

    q, k = normalized(*inputs[:2])
    out, final = segment_tree_delta_rule(q, k, *inputs[2:5], plan, inputs[5], output_final_state=True)
    got = torch.autograd.grad((out * weight).sum() + (final * final_weight).sum(), inputs)

    q, k = normalized(*inputs[:2])
    loss = 0
    for s, (seg_out, seg_final) in enumerate(plain_forest(q, k, *inputs[2:5], FOREST, inputs[5])):
        loss = loss + (seg_out * weight[start[s]: start[s]
                                        + length[s]]).sum() + (seg_final * final_weight[s]).sum()
    want = torch.autograd.grad(loss, inputs)
    for name, a, b in zip(("q", "k", "v", "g", "beta", "initial"), got, want):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-8, msg=name)


def test_the_state_pass_takes_as_many_steps_as_the_longest_path_has_chunks():
    parent, start, length = forest_arrays(FOREST)
    plan = ChunkPlan.build(parent, start, length, 4)
    chunks = -(-length // 4)
    path_chunks = [sum(chunks[a] for a in _ancestors(s, parent)) for s in range(len(FOREST))]
    assert len(plan.step_sizes) == max(path_chunks)
    assert plan.num_chunks == int(chunks.sum()) == plan.chunk_tokens.shape[0]
    # every token in exactly one chunk slot
    real = plan.chunk_tokens[plan.chunk_tokens < plan.num_tokens]
    assert sorted(real.tolist()) == list(range(plan.num_tokens))
    assert (plan.chunk_tokens.flatten()[plan.token_slot] == torch.arange(plan.num_tokens)).all()


def _ancestors(segment, parent):
    while segment >= 0:
        yield segment
        segment = parent[segment]


def test_a_padded_batch_of_one_token_chunks_is_the_token_recurrence():
    """The server's decode step: chunks of one token from a batch of states."""
    q, k, v, g, beta = random_inputs(6, seed=6)
    q, k = normalized(q, k)
    state = torch.randn(2, 4, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(7))
    out, final = chunk_gated_delta_rule(q[None], k[None], v[None], g[None], beta[None],
                                        state[None], chunk_size=1)
    want_out, want_final = plain_delta_rule(q, k, v, g, beta, state, normalize=False)
    torch.testing.assert_close(out[0], want_out, atol=1e-12, rtol=1e-10)
    torch.testing.assert_close(final[0], want_final, atol=1e-12, rtol=1e-10)


def test_a_plan_refuses_empty_segments_and_children_before_their_parents():
    with pytest.raises(ValueError, match="empty segment"):
        ChunkPlan.build([-1, 0], [0, 3], [3, 0], 4)
    with pytest.raises(ValueError, match="after its parent"):
        ChunkPlan.build([1, -1], [0, 3], [3, 2], 4)
