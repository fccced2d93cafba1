"""Tests for asyncgrpo.train.logprobs: chunked log-probs against plain full-logit computations."""

from __future__ import annotations

import math

import pytest
import torch

from asyncgrpo.packing.tree import Sample, pack_row
from asyncgrpo.train.logprobs import token_logprobs, token_logprobs_reference

V, H, T, N, K = 37, 8, 9, 11, 4


def _make_inputs(
    seed: int, dtype=torch.float32, bias: bool = False, n: int = N, topk: bool = True, cands: bool = False
):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(T, H, generator=g).to(dtype).requires_grad_()
    weight = (torch.randn(V, H, generator=g) / math.sqrt(H) * 3).to(dtype).requires_grad_()
    b = (torch.randn(V, generator=g) * 0.5).to(dtype).requires_grad_() if bias else None
    pred_index = torch.randint(0, T, (n,), generator=g)
    target_ids = torch.randint(0, V, (n,), generator=g)
    inputs = {
        "hidden": hidden,
        "lm_head_weight": weight,
        "lm_head_bias": b,
        "pred_index": pred_index,
        "target_ids": target_ids,
    }
    candidate_sets = None
    if cands:
        # Random candidate set per token that always holds the target; sizes vary (1 .. V).
        candidate_sets = []
        for i in range(n):
            size = int(torch.randint(1, V + 1, (1,), generator=g))
            ids = torch.randperm(V, generator=g)[:size].tolist()
            if int(target_ids[i]) not in ids:
                ids[0] = int(target_ids[i])
            candidate_sets.append(sorted(ids))
        inputs["candidate_ids"] = torch.tensor([v for s in candidate_sets for v in s], dtype=torch.long)
        offsets = [0]
        for s in candidate_sets:
            offsets.append(offsets[-1] + len(s))
        inputs["candidate_offsets"] = torch.tensor(offsets, dtype=torch.long)
    if topk:
        ids = torch.stack([torch.randperm(V, generator=g)[:K] for _ in range(n)])
        ids[0, -1] = -1  # pad entries
        if n > 3:
            ids[3, 1:] = -1
        inputs["topk_ids"] = ids
    return inputs, candidate_sets


def _brute_force(inputs, candidate_sets, temperature, softcap, scale=1.0):
    """Per-token loop in fp64: logits, log-softmax, renormalisation over the candidate set."""
    hidden = inputs["hidden"].double()
    weight = inputs["lm_head_weight"].double()
    bias = inputs["lm_head_bias"]
    targets, topks, entropies = [], [], []
    for i in range(len(inputs["target_ids"])):
        x = weight @ hidden[int(inputs["pred_index"][i])]
        if bias is not None:
            x = x + bias.double()
        x = x * scale
        if softcap is not None:
            x = softcap * torch.tanh(x / softcap)
        log_pi = torch.log_softmax(x / temperature, dim=0)
        entropies.append(-(log_pi.exp() * log_pi).sum())
        members = list(range(V)) if candidate_sets is None or candidate_sets[i] is None else candidate_sets[i]
        log_norm = torch.logsumexp(log_pi[members], dim=0)
        targets.append(log_pi[int(inputs["target_ids"][i])] - log_norm)
        if "topk_ids" in inputs:
            row = []
            for v in inputs["topk_ids"][i].tolist():
                if v < 0 or v not in members:
                    row.append(torch.tensor(float("-inf"), dtype=torch.float64))
                else:
                    row.append(log_pi[v] - log_norm)
            topks.append(torch.stack(row))
    topk = torch.stack(topks) if topks else None
    return torch.stack(targets), topk, torch.stack(entropies)


def _objective(target, topk, seed=123):
    """A scalar with distinct random weights on every finite output, to compare gradients."""
    g = torch.Generator().manual_seed(seed)
    c = torch.randn(target.shape, generator=g, dtype=torch.float64)
    total = (c * target.double()).sum()
    if topk is not None:
        ck = torch.randn(topk.shape, generator=g, dtype=torch.float64)
        finite = torch.isfinite(topk)
        total = total + (ck * torch.where(finite, topk.double(), 0.0)).sum()
    return total


def _grads(inputs, outputs):
    params = [inputs["hidden"], inputs["lm_head_weight"]] + (
        [inputs["lm_head_bias"]] if inputs["lm_head_bias"] is not None else []
    )
    loss = _objective(outputs[0], outputs[1])
    return torch.autograd.grad(loss, params)


def _clone_leaves(inputs):
    out = dict(inputs)
    for key in ("hidden", "lm_head_weight", "lm_head_bias"):
        if out[key] is not None:
            out[key] = out[key].detach().clone().requires_grad_()
    return out


@pytest.mark.parametrize(
    "temperature,softcap,bias,cands,chunk_size",
    [
        (1.0, None, False, False, 4),
        (0.7, None, True, False, 3),
        (1.3, 5.0, False, True, 4),
        (0.6, None, True, True, 1),
        (1.0, 2.0, True, True, 64),
    ],
)
def test_chunked_logprobs_match_fp64_brute_force_values_and_grads(
    temperature, softcap, bias, cands, chunk_size
):
    inputs, candidate_sets = _make_inputs(0, bias=bias, cands=cands)
    out = token_logprobs(**inputs, temperature=temperature, logit_softcapping=softcap, chunk_size=chunk_size)

    ref_inputs = _clone_leaves(inputs)
    ref = _brute_force(ref_inputs, candidate_sets, temperature, softcap)

    torch.testing.assert_close(out.target_logprobs.double(), ref[0], rtol=1e-5, atol=1e-5)
    assert torch.equal(torch.isinf(out.topk_logprobs), torch.isinf(ref[1]))
    finite = torch.isfinite(ref[1])
    torch.testing.assert_close(out.topk_logprobs[finite].double(), ref[1][finite], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.entropy.double(), ref[2], rtol=1e-5, atol=1e-5)
    assert not out.entropy.requires_grad

    for got, want in zip(_grads(inputs, (out.target_logprobs, out.topk_logprobs)), _grads(ref_inputs, ref)):
        torch.testing.assert_close(got.double(), want.double(), rtol=1e-4, atol=1e-5)


def test_chunked_logprobs_match_the_plain_reference_implementation():
    inputs, _ = _make_inputs(1, bias=True, cands=True)
    out = token_logprobs(**inputs, temperature=0.8, logit_softcapping=4.0, chunk_size=5)
    ref_inputs = _clone_leaves(inputs)
    ref = token_logprobs_reference(**ref_inputs, temperature=0.8, logit_softcapping=4.0)
    torch.testing.assert_close(out.target_logprobs, ref.target_logprobs)
    torch.testing.assert_close(out.topk_logprobs, ref.topk_logprobs)
    torch.testing.assert_close(out.entropy, ref.entropy)
    for got, want in zip(
        _grads(inputs, (out.target_logprobs, out.topk_logprobs)),
        _grads(ref_inputs, (ref.target_logprobs, ref.topk_logprobs)),
    ):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_bf16_inputs_give_fp32_outputs_close_to_fp64():
    inputs, candidate_sets = _make_inputs(2, dtype=torch.bfloat16, bias=True, cands=True)
    out = token_logprobs(**inputs, temperature=0.9, chunk_size=4)
    assert out.target_logprobs.dtype == torch.float32
    ref_inputs = _clone_leaves(inputs)
    ref = _brute_force(ref_inputs, candidate_sets, 0.9, None)
    # Logits are rounded to bf16 by the matmul (|logit| ~ 5, bf16 spacing 2^-5), then fp32 onwards.
    torch.testing.assert_close(out.target_logprobs.double(), ref[0], rtol=0, atol=0.03)
    torch.testing.assert_close(out.entropy.double(), ref[2], rtol=0, atol=0.03)
    got = _grads(inputs, (out.target_logprobs, out.topk_logprobs))
    want = _grads(ref_inputs, ref)
    for g, w in zip(got, want):
        assert g.dtype == torch.bfloat16
        err = (g.double() - w.double()).norm() / w.double().norm()
        assert err < 0.015, err


def test_topk_and_topp_candidate_sets_renormalise_like_a_direct_computation():
    g = torch.Generator().manual_seed(3)
    n, temperature = 6, 0.7
    hidden = torch.randn(n, H, generator=g, dtype=torch.float64)
    weight = torch.randn(V, H, generator=g, dtype=torch.float64)
    probs = torch.softmax(hidden @ weight.T / temperature, dim=-1)  # processed distribution
    sets = []
    for i in range(n):
        order = torch.argsort(probs[i], descending=True)
        if i % 2 == 0:  # top-k = 5
            sets.append(order[:5].tolist())
        else:  # top-p = 0.8: smallest prefix whose mass reaches 0.8
            cumulative = torch.cumsum(probs[i][order], dim=0)
            size = int((cumulative < 0.8).sum()) + 1
            sets.append(order[:size].tolist())
    targets = torch.tensor([s[-1] for s in sets])
    offsets = torch.tensor([0] + [len(s) for s in sets]).cumsum(0)
    width = max(len(s) for s in sets) + 2
    topk_ids = torch.full((n, width), -1, dtype=torch.long)
    for i, s in enumerate(sets):
        topk_ids[i, : len(s)] = torch.tensor(s)
        topk_ids[i, len(s)] = int(torch.argsort(probs[i])[0])  # least likely token: outside every set
    out = token_logprobs(
        hidden,
        weight,
        torch.arange(n),
        targets,
        temperature=temperature,
        topk_ids=topk_ids,
        candidate_ids=torch.tensor([v for s in sets for v in s]),
        candidate_offsets=offsets,
        chunk_size=4,
    )
    for i, s in enumerate(sets):
        mass = probs[i][s].sum()
        want = probs[i][targets[i]] / mass
        torch.testing.assert_close(out.target_logprobs[i].exp(), want)
        torch.testing.assert_close(out.topk_logprobs[i, : len(s)].exp(), probs[i][s] / mass)
        torch.testing.assert_close(
            out.topk_logprobs[i, : len(s)].exp().sum(), torch.tensor(1.0, dtype=torch.float64)
        )
        assert out.topk_logprobs[i, len(s)] == float("-inf")  # outside the candidate set
        assert torch.all(out.topk_logprobs[i, len(s) + 1 :] == float("-inf"))  # pads


def test_memory_bound_saved_tensors_hold_no_full_vocab_logits():
    g = torch.Generator().manual_seed(4)
    vocab, hid, n = 500, 4, 40  # N * V = 20000 > V * H = 2000
    hidden = torch.randn(n, hid, generator=g, requires_grad=True)
    weight = torch.randn(vocab, hid, generator=g, requires_grad=True)
    targets = torch.randint(0, vocab, (n,), generator=g)
    topk_ids = torch.randint(0, vocab, (n, 3), generator=g)

    def largest_saved(fn) -> int:
        sizes = []

        def pack(t):
            sizes.append(t.numel())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = fn(hidden, weight, torch.arange(n), targets, topk_ids=topk_ids, temperature=0.5)
        (out.target_logprobs.sum() + out.topk_logprobs.sum()).backward()
        return max(sizes)

    assert largest_saved(lambda *a, **k: token_logprobs(*a, **k, chunk_size=8)) <= vocab * hid
    assert largest_saved(token_logprobs_reference) >= n * vocab  # the plain path keeps [N, V]


def test_frozen_lm_head_gets_no_gradient_and_hidden_gradient_is_unchanged():
    inputs, _ = _make_inputs(5)
    frozen = _clone_leaves(inputs)
    frozen["lm_head_weight"].requires_grad_(False)
    out_frozen = token_logprobs(**frozen, chunk_size=4)
    out = token_logprobs(**inputs, chunk_size=4)
    (g_frozen,) = torch.autograd.grad(
        _objective(out_frozen.target_logprobs, out_frozen.topk_logprobs), [frozen["hidden"]]
    )
    g_full = _grads(inputs, (out.target_logprobs, out.topk_logprobs))[0]
    torch.testing.assert_close(g_frozen, g_full)
    assert frozen["lm_head_weight"].grad is None


def test_autocast_does_not_change_the_result():
    inputs, _ = _make_inputs(6, cands=True)
    want = token_logprobs(**inputs, chunk_size=4).target_logprobs
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = token_logprobs(**inputs, chunk_size=4).target_logprobs
    torch.testing.assert_close(got, want)


def test_no_trained_tokens_and_no_topk():
    inputs, _ = _make_inputs(7, n=0, topk=False)
    out = token_logprobs(**inputs)
    assert out.target_logprobs.shape == (0,) and out.entropy.shape == (0,) and out.topk_logprobs is None
    (out.target_logprobs.sum() + inputs["hidden"].sum() * 0).backward()
    assert torch.count_nonzero(inputs["lm_head_weight"].grad) == 0


def test_shared_prediction_position_accumulates_gradient():
    # Two trained tokens read the same hidden row (allowed by pred_index); gradients must add up.
    inputs, _ = _make_inputs(8, topk=False)
    inputs["pred_index"] = torch.zeros(N, dtype=torch.long)
    out = token_logprobs(**inputs, chunk_size=3)
    ref_inputs = _clone_leaves(inputs)
    ref = token_logprobs_reference(**ref_inputs)
    for got, want in zip(
        _grads(inputs, (out.target_logprobs, None)), _grads(ref_inputs, (ref.target_logprobs, None))
    ):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_bad_arguments_name_the_problem():
    inputs, _ = _make_inputs(9)
    with pytest.raises(ValueError, match="temperature"):
        token_logprobs(**inputs, temperature=0.0)
    with pytest.raises(ValueError, match="candidate_offsets"):
        token_logprobs(**inputs, candidate_ids=torch.tensor([1]), candidate_offsets=torch.tensor([0, 1]))


def test_gradient_sent_to_minus_inf_topk_entries_is_ignored():
    # Pads and tokens outside the candidate set are constants (-inf): any upstream gradient on them
    # must not leak into the logits.
    inputs, _ = _make_inputs(10, cands=True)
    out = token_logprobs(**inputs, chunk_size=4)
    finite = torch.isfinite(out.topk_logprobs)
    assert (~finite).sum() > 3
    ones = torch.ones_like(out.topk_logprobs)
    params = [inputs["hidden"], inputs["lm_head_weight"]]
    got = torch.autograd.grad(out.topk_logprobs, params, grad_outputs=ones, retain_graph=True)
    want = torch.autograd.grad(out.topk_logprobs, params, grad_outputs=finite.float())
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)


@pytest.mark.parametrize("chunk_size", [1, 3, 64])
def test_tokens_without_a_candidate_set_use_the_full_vocabulary_beside_tokens_with_one(chunk_size):
    # A custom generate_one_turn may return output_sampling_mask=None (the full vocabulary) for some
    # turns: a row then mixes tokens with and without candidate sets. Each must be normalised over
    # its own set, and nothing may become infinite.
    with_sets = Sample([1, 2, 3, 4, 9], [0, 0, 1, 1, 1], [0, 0, -1, -1, -1], 1.0, 0,
                       candidate_sets=[None, None, [3, 5], None, [4, 9, 11]])
    without = Sample([1, 2, 7, 8], [0, 0, 1, 1], [0, 0, -1, -1], -1.0, 0)
    row = pack_row([with_sets, without])
    sets = [[3, 5], None, [4, 9, 11], None, None]  # per trained token, in row order
    assert row.candidate_offsets.diff().tolist() == [0 if s is None else len(s) for s in sets]
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(row.num_tokens, H, generator=g, dtype=torch.float64).requires_grad_()
    weight = (torch.randn(V, H, generator=g, dtype=torch.float64) * 0.8).requires_grad_()
    inputs = {"hidden": hidden, "lm_head_weight": weight, "lm_head_bias": None,
              "pred_index": row.pred_index, "target_ids": row.target_ids}
    out = token_logprobs(**inputs, candidate_ids=row.candidate_ids, candidate_offsets=row.candidate_offsets,
                         chunk_size=chunk_size)
    want, _, _ = _brute_force(inputs, sets, 1.0, None)
    assert torch.isfinite(out.target_logprobs).all()
    torch.testing.assert_close(out.target_logprobs, want)
    ref = token_logprobs_reference(**_clone_leaves(inputs), candidate_ids=row.candidate_ids,
                                   candidate_offsets=row.candidate_offsets)
    torch.testing.assert_close(ref.target_logprobs, want)
    got_grads = torch.autograd.grad(out.target_logprobs.sum(), [hidden, weight])
    want_grads = torch.autograd.grad(want.sum(), [hidden, weight])
    for got, expected in zip(got_grads, want_grads):
        torch.testing.assert_close(got, expected)


@pytest.mark.parametrize("scale,softcap", [(0.0625, None), (0.25, 3.0), (4.0, None)])
def test_model_logit_scale_matches_fp64_brute_force_values_and_grads(scale, softcap):
    # Cohere multiplies hidden @ W by logit_scale, Granite divides by logits_scaling (scale 1/4).
    inputs, candidate_sets = _make_inputs(11, dtype=torch.float64, bias=True, cands=True)
    out = token_logprobs(**inputs, temperature=0.8, logit_scale=scale,
                         logit_softcapping=softcap, chunk_size=3)
    ref_inputs = _clone_leaves(inputs)
    want = _brute_force(ref_inputs, candidate_sets, 0.8, softcap, scale)
    torch.testing.assert_close(out.target_logprobs, want[0])
    torch.testing.assert_close(out.topk_logprobs, want[1])
    torch.testing.assert_close(out.entropy, want[2])
    for got, expected in zip(_grads(inputs, (out.target_logprobs, out.topk_logprobs)),
                             _grads(ref_inputs, want[:2])):
        torch.testing.assert_close(got, expected)


@pytest.mark.parametrize(
    "temperature,scale,softcap,bias,chunk_size",
    [(1.0, 1.0, None, False, 4), (0.7, 1.0, None, True, 3), (1.3, 0.25, 5.0, False, 64),
     (0.6, 4.0, 2.0, True, 1)],
)
def test_fused_epilogue_matches_fp64_brute_force_values_and_grads(temperature, scale,
                                                                  softcap, bias, chunk_size):
    """`fused=True` (the kernels compiled on CUDA, run eagerly here) against the per-token fp64 loop:
    values, top-K with pad entries, entropy, and the gradients of hidden, weight and bias."""
    inputs, _ = _make_inputs(21, dtype=torch.float64, bias=bias)
    out = token_logprobs(**inputs, temperature=temperature, logit_scale=scale, logit_softcapping=softcap,
                         chunk_size=chunk_size, fused=True)
    ref_inputs = _clone_leaves(inputs)
    want = _brute_force(ref_inputs, None, temperature, softcap, scale)
    torch.testing.assert_close(out.target_logprobs, want[0])
    torch.testing.assert_close(out.topk_logprobs, want[1])
    torch.testing.assert_close(out.entropy, want[2])
    for got, expected in zip(_grads(inputs, (out.target_logprobs, out.topk_logprobs)),
                             _grads(ref_inputs, want[:2])):
        torch.testing.assert_close(got, expected)


def test_fused_epilogue_in_bf16_matches_the_plain_path():
    """The fused path rounds the dense logit gradient to bf16 once; values and gradients stay within
    bf16 rounding of the plain path's."""
    inputs, _ = _make_inputs(22, dtype=torch.bfloat16, bias=True)
    plain = token_logprobs(**inputs, temperature=0.9, chunk_size=4)
    fused_inputs = _clone_leaves(inputs)
    fused = token_logprobs(**fused_inputs, temperature=0.9, chunk_size=4, fused=True)
    torch.testing.assert_close(fused.target_logprobs, plain.target_logprobs, atol=1e-5, rtol=0)
    torch.testing.assert_close(fused.topk_logprobs, plain.topk_logprobs, atol=1e-5, rtol=0)
    for got, want in zip(_grads(fused_inputs, (fused.target_logprobs, fused.topk_logprobs)),
                         _grads(inputs, (plain.target_logprobs, plain.topk_logprobs))):
        torch.testing.assert_close(got.float(), want.float(), atol=2e-2 * float(want.abs().max()), rtol=0)


def test_fused_request_with_candidate_sets_takes_the_plain_path():
    inputs, candidate_sets = _make_inputs(23, dtype=torch.float64, cands=True)
    out = token_logprobs(**inputs, temperature=0.8, chunk_size=3, fused=True)
    want = _brute_force(_clone_leaves(inputs), candidate_sets, 0.8, None)
    torch.testing.assert_close(out.target_logprobs, want[0])
