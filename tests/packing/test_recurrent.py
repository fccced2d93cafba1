"""Recurrent mixing on tree-packed rows: the chunked delta rule and the trie-following convolution
against plain per-token computations over each sample alone."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from asyncgrpo.modeling.deltanet.delta_rule import chunk_gated_delta_rule
from asyncgrpo.packing import Sample, pack_row, sample_paths
from asyncgrpo.packing.recurrent import (
    RecurrentLayout,
    resolve_delta_rule_backend,
    tree_causal_conv1d,
    tree_gated_delta_rule,
)

VOCAB = 50


def l2(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6)


def plain_delta_rule(q, k, v, g, beta, state=None, normalize=True):
    """The recurrence token by token: S = e^g S; S += k (beta (v - S^T k))^T; o = S^T q.
    q/k [L, H, K], v [L, H, V], g/beta [L, H], state [H, K, V]. Returns (o [L, H, V], S)."""
    if normalize:
        q, k = l2(q) * q.shape[-1] ** -0.5, l2(k)
    length, heads, dim_k = k.shape
    if state is None:
        state = q.new_zeros(heads, dim_k, v.shape[-1])
    out = []
    for t in range(length):
        state = state * g[t].exp()[:, None, None]
        delta = (v[t] - torch.einsum("hkv,hk->hv", state, k[t])) * beta[t][:, None]
        state = state + k[t][:, :, None] * delta[:, None, :]
        out.append(torch.einsum("hkv,hk->hv", state, q[t]))
    return torch.stack(out), state


def random_inputs(length, heads=2, dim_k=4, dim_v=3, seed=0, dtype=torch.float64, key_heads=None):
    gen = torch.Generator().manual_seed(seed)
    key_heads = key_heads or heads
    q = torch.randn(length, key_heads, dim_k, generator=gen, dtype=dtype)
    k = torch.randn(length, key_heads, dim_k, generator=gen, dtype=dtype)
    v = torch.randn(length, heads, dim_v, generator=gen, dtype=dtype)
    g = -F.softplus(torch.randn(length, heads, generator=gen, dtype=dtype)) * 0.3
    beta = torch.sigmoid(torch.randn(length, heads, generator=gen, dtype=dtype))
    return q, k, v, g, beta


@pytest.mark.parametrize("length,chunk_size", [(1, 4), (7, 4), (8, 4), (29, 8), (70, 64), (130, 64)])
def test_chunked_delta_rule_equals_the_token_recurrence(length, chunk_size):
    q, k, v, g, beta = random_inputs(length)
    gen = torch.Generator().manual_seed(1)
    state = torch.randn(2, 4, 3, generator=gen, dtype=torch.float64)
    ref_out, ref_state = plain_delta_rule(q, k, v, g, beta, state)
    qn, kn = l2(q) * q.shape[-1] ** -0.5, l2(k)
    out, final = chunk_gated_delta_rule(qn[None], kn[None], v[None], g[None], beta[None],
                                        state[None], chunk_size)
    torch.testing.assert_close(out[0], ref_out, atol=1e-12, rtol=1e-10)
    torch.testing.assert_close(final[0], ref_state, atol=1e-12, rtol=1e-10)


def test_zero_padding_at_the_end_keeps_each_final_state():
    lengths = [5, 13, 1]
    q, k, v, g, beta = random_inputs(13, seed=3)
    padded = [torch.zeros(len(lengths), 13, *x.shape[1:], dtype=x.dtype) for x in (q, k, v, g, beta)]
    for i, n in enumerate(lengths):
        for dst, src in zip(padded, (q, k, v, g, beta)):
            dst[i, :n] = src[:n]
    qn, kn = l2(padded[0]) * 4 ** -0.5, l2(padded[1])
    out, final = chunk_gated_delta_rule(qn, kn, *padded[2:], chunk_size=4)
    for i, n in enumerate(lengths):
        ref_out, ref_state = plain_delta_rule(q[:n], k[:n], v[:n], g[:n], beta[:n])
        torch.testing.assert_close(out[i, :n], ref_out, atol=1e-12, rtol=1e-10)
        torch.testing.assert_close(final[i], ref_state, atol=1e-12, rtol=1e-10)


def trie_samples(rng: np.random.Generator) -> list[Sample]:
    """Forks at several depths, a segment of one token, segments shorter than the conv window (so a
    window reaches grandparents), a duplicate, samples sharing nothing, segments over 64 tokens."""
    def tokens(n):
        return [int(t) for t in rng.integers(0, VOCAB, n)]

    prompt = tokens(3)
    turn = prompt + tokens(70)  # the first completion is longer than one chunk
    seqs = [
        turn + tokens(5),
        turn + tokens(90),  # forks right after the long segment
        prompt[:1] + tokens(2),  # forks after the first token: one-token root segment
        prompt[:2] + tokens(1),  # and after the second: [p1] -> [p2] -> ...
        prompt + tokens(4),
        turn + tokens(3),  # another child of the long segment
        tokens(6),  # shares nothing
        prompt + tokens(140),  # a long sibling, several chunks
    ]
    seqs.append(list(seqs[0]))  # a duplicate
    samples = []
    for i, s in enumerate(seqs):
        mask = [False] + [True] * (len(s) - 1)
        samples.append(Sample(s, mask, [0.0] * len(s), 1.0, i))
    return samples


def per_sample(x: torch.Tensor, paths: list[np.ndarray]) -> list[torch.Tensor]:
    return [x[torch.as_tensor(p)] for p in paths]


def test_layout_levels_and_conv_windows_follow_each_sample_path():
    row = pack_row(trie_samples(np.random.default_rng(0)))
    layout = RecurrentLayout.build(row.segment_parent, row.segment_start, row.segment_len, conv_width=4)
    assert len(layout.levels) >= 4 and min(row.segment_len.tolist()) == 1
    segments_seen = torch.cat([lvl.token_index for lvl in layout.levels])
    assert sorted(segments_seen.tolist()) == list(range(row.num_tokens))
    # each token's window: the three tokens before it on its own path
    for path in sample_paths(row):
        for depth, token in enumerate(path):
            window = layout.conv_index[int(layout.conv_keep[token]) - 3: int(layout.conv_keep[token]) + 1]
            expected = [row.num_tokens] * max(0, 3 - depth) + path[max(0, depth - 3): depth + 1].tolist()
            assert window.tolist() == expected


@pytest.mark.parametrize("width", [1, 2, 4])
def test_tree_convolution_equals_each_sample_convolved_alone(width):
    row = pack_row(trie_samples(np.random.default_rng(1)))
    layout = RecurrentLayout.build(row.segment_parent, row.segment_start, row.segment_len, conv_width=width)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(row.num_tokens, 6, generator=gen, dtype=torch.float64)
    weight = torch.randn(6, width, generator=gen, dtype=torch.float64)
    bias = torch.randn(6, generator=gen, dtype=torch.float64)
    packed = tree_causal_conv1d(x, weight, bias, layout, "silu")
    paths = sample_paths(row)
    for path, xs in zip(paths, per_sample(x, paths)):
        alone = F.silu(
            F.conv1d(xs.T[None], weight[:, None], bias, padding=width - 1, groups=6)[0, :, : len(path)].T)
        torch.testing.assert_close(packed[torch.as_tensor(path)], alone, atol=1e-12, rtol=0)


@pytest.mark.parametrize("key_heads", [2, 1])
def test_tree_delta_rule_starts_each_segment_from_its_parents_final_state(key_heads):
    row = pack_row(trie_samples(np.random.default_rng(2)))
    layout = RecurrentLayout.build(row.segment_parent, row.segment_start, row.segment_len, conv_width=4)
    q, k, v, g, beta = random_inputs(row.num_tokens, heads=2, key_heads=key_heads, seed=4)
    packed = tree_gated_delta_rule(q, k, v, g, beta, layout, backend="torch")
    paths = sample_paths(row)
    for path in paths:
        idx = torch.as_tensor(path)
        qs, ks = (x[idx].repeat_interleave(2 // key_heads, dim=1) for x in (q, k))
        alone, _ = plain_delta_rule(qs, ks, v[idx], g[idx], beta[idx])
        torch.testing.assert_close(packed[idx], alone, atol=1e-11, rtol=1e-9)


def test_tree_delta_rule_gradients_equal_the_sum_over_samples_alone():
    row = pack_row(trie_samples(np.random.default_rng(3)))
    layout = RecurrentLayout.build(row.segment_parent, row.segment_start, row.segment_len, conv_width=4)
    inputs = [x.requires_grad_() for x in random_inputs(row.num_tokens, seed=5)]
    weight = torch.randn(row.num_tokens, 2, 3, dtype=torch.float64)
    paths = sample_paths(row)
    # loss: each sample's outputs on its path (a shared token is counted once per sample through it)
    counts = torch.zeros(row.num_tokens, dtype=torch.float64)
    for path in paths:
        counts[torch.as_tensor(path)] += 1
    packed = tree_gated_delta_rule(*inputs, layout, backend="torch")
    packed_grads = torch.autograd.grad((packed * weight * counts[:, None, None]).sum(), inputs)
    loss = 0
    for path in paths:
        idx = torch.as_tensor(path)
        alone, _ = plain_delta_rule(*(x[idx] for x in inputs))
        loss = loss + (alone * weight[idx]).sum()
    plain_grads = torch.autograd.grad(loss, inputs)
    for got, want in zip(packed_grads, plain_grads):
        torch.testing.assert_close(got, want, atol=1e-10, rtol=1e-8)


def test_a_root_only_row_is_plain_padding_free_packing():
    rng = np.random.default_rng(4)
    samples = [Sample([int(t) for t in rng.integers(0, VOCAB, n)],
                      [False] + [True] * (n - 1), [0.0] * n, 0.0, i)
               for i, n in enumerate([3, 80, 2, 17])]
    row = pack_row(samples, share_prefixes=False)
    layout = RecurrentLayout.build(row.segment_parent, row.segment_start, row.segment_len, conv_width=4)
    assert len(layout.levels) == 1
    q, k, v, g, beta = random_inputs(row.num_tokens, seed=6)
    packed = tree_gated_delta_rule(q, k, v, g, beta, layout, backend="torch")
    for start, length in zip(row.segment_start.tolist(), row.segment_len.tolist()):
        sl = slice(start, start + length)
        torch.testing.assert_close(packed[sl], plain_delta_rule(q[sl], k[sl], v[sl], g[sl], beta[sl])[0],
                                   atol=1e-11, rtol=1e-9)


def test_backend_choice_names_what_is_missing():
    assert resolve_delta_rule_backend("auto", torch.device("cpu")) == "torch"
    with pytest.raises(ValueError, match="CUDA only"):
        resolve_delta_rule_backend("fla", torch.device("cpu"))
    with pytest.raises(ValueError, match="one of"):
        resolve_delta_rule_backend("triton", torch.device("cpu"))


def test_layout_refuses_segments_out_of_depth_first_order():
    with pytest.raises(ValueError, match="depth-first"):
        RecurrentLayout.build([-1, 2, 0], [0, 1, 2], [1, 1, 1], conv_width=4)


def test_a_check_run_isolated_inside_a_checkpointed_forward_leaves_the_checkpoint_intact():
    """The fla training check runs once, lazily, from inside a (checkpointed) layer forward; it must
    not add its own saved tensors to the checkpoint, or the recomputation (which skips the cached
    check) would save fewer tensors and the backward would fail."""
    from torch.utils.checkpoint import checkpoint

    from asyncgrpo.packing.recurrent import run_isolated

    def own_forward_and_backward():
        x = torch.randn(4, 4, requires_grad=True)
        (x.sin() * x).sum().backward()
        return torch.is_grad_enabled()

    checked = []

    def layer(x):
        if not checked:
            checked.append(run_isolated(own_forward_and_backward))
        return (x.exp() * x.sin()).sum()

    x = torch.randn(8, requires_grad=True)
    checkpoint(layer, x, use_reentrant=False).backward()
    expected = (x.exp() * x.sin() + x.exp() * x.cos()).detach()
    torch.testing.assert_close(x.grad, expected)
    assert checked == [True]
    with torch.no_grad():  # the caller's grad mode does not reach the check either
        assert run_isolated(torch.is_grad_enabled) is True


def fla_shaped_plain_kernel(calls):
    """fla-core's `chunk_gated_delta_rule` API (B = 1, varlen `cu_seqlens`, one initial/final state per
    sequence, scale K^-1/2 by default) computed by the token recurrence: stands in for the Triton
    kernel on CPU so that the "fla" backend's levels, offsets and states are checked here."""
    def kernel(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
               use_qk_l2norm_in_kernel=False, cu_seqlens=None):
        calls.append(use_qk_l2norm_in_kernel)
        assert q.shape[0] == 1 and cu_seqlens is not None
        scale = q.shape[-1] ** -0.5 if scale is None else scale
        outs, finals = [], []
        for n, (start, end) in enumerate(zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist())):
            state = None if initial_state is None else initial_state[n]
            qs, ks = q[0, start:end], k[0, start:end]
            if use_qk_l2norm_in_kernel:
                qs, ks = l2(qs), l2(ks)
            out, state = plain_delta_rule(qs * scale, ks, v[0, start:end],
                                          g[0, start:end], beta[0, start:end], state, normalize=False)
            outs.append(out)
            finals.append(state)
        return torch.cat(outs)[None], torch.stack(finals) if output_final_state else None
    return kernel


@pytest.mark.parametrize("key_heads", [2, 1])
def test_the_fla_backend_runs_levels_as_varlen_calls_from_the_parents_states(monkeypatch, key_heads):
    from asyncgrpo.packing import recurrent

    calls = []
    monkeypatch.setattr(recurrent, "_fla_kernel", lambda: (fla_shaped_plain_kernel(calls), None))
    row = pack_row(trie_samples(np.random.default_rng(6)))
    layout = RecurrentLayout.build(row.segment_parent, row.segment_start, row.segment_len, conv_width=4)
    q, k, v, g, beta = random_inputs(row.num_tokens, heads=2, key_heads=key_heads, seed=7)
    packed = tree_gated_delta_rule(q, k, v, g, beta, layout, backend="fla")
    assert len(calls) == len(layout.levels) and not any(calls)  # q/k arrive l2-normalised
    torch.testing.assert_close(packed, tree_gated_delta_rule(q, k, v, g, beta, layout, backend="torch"),
                               atol=1e-11, rtol=1e-9)
