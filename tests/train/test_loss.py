"""Tests for asyncgrpo.train.loss: per-token loop references, normalisation, score-centering properties,
metric values."""

from __future__ import annotations

import math

import pytest
import torch

from asyncgrpo.train.logprobs import token_logprobs
from asyncgrpo.train.loss import (
    clipped_surrogate_token_loss,
    importance_mask,
    importance_ratio,
    loss_metrics,
    merge_loss_stats,
    policy_loss,
    score_centering_token_loss,
)

EPS, EPS_HIGH, C_MIN, C_MAX = 0.2, 0.28, 0.5, 5.0


def _batch(seed: int = 0, n: int = 24, k: int = 5):
    """fp64 log-probs whose ratios cover every branch: masked low/high, clipped low/high, inside."""
    g = torch.Generator().manual_seed(seed)
    log_ratio = torch.tensor([-1.2, -0.5, -0.1, 0.05, 0.2, 0.4, 1.0, 2.0] * (n // 8), dtype=torch.float64)
    sampler_lp = -torch.rand(n, generator=g, dtype=torch.float64) * 3
    lp = (sampler_lp + log_ratio).requires_grad_()
    adv = torch.randn(n, generator=g, dtype=torch.float64)
    adv[::3] = -adv[::3].abs()
    adv[1::3] = adv[1::3].abs()
    sampler_topk = -torch.rand(n, k, generator=g, dtype=torch.float64) * 4 - 0.5
    topk_log_ratio = torch.randn(n, k, generator=g, dtype=torch.float64)
    topk_log_ratio[:, 0] = 2.0  # rho = 7.4 > C_max: masked
    topk_log_ratio[:, 1] = -1.0  # rho = 0.37 < C_min: masked
    topk_lp = sampler_topk + topk_log_ratio
    sampler_topk[2, -1] = float("-inf")  # pad entry
    topk_lp[2, -1] = float("-inf")
    topk_lp[5, -2] = float("-inf")  # token outside the candidate set: pi~ = 0
    topk_lp = topk_lp.requires_grad_()
    sample_index = torch.arange(n) // 5
    return lp, sampler_lp, adv, topk_lp, sampler_topk, sample_index


def _clipped_reference(lp, slp, adv, eps=EPS, eps_high=EPS_HIGH):
    """Per-token loop, explicit branches."""
    out = []
    for t in range(len(lp)):
        rho = torch.exp(lp[t] - slp[t])
        if not (C_MIN <= rho.item() <= C_MAX):
            out.append(lp[t] * 0.0)
            continue
        unclipped = rho * adv[t]
        clipped = torch.clamp(rho, 1 - eps, 1 + eps_high) * adv[t]
        out.append(-(unclipped if unclipped.item() <= clipped.item() else clipped))
    return torch.stack(out)


def _centering_reference(lp, slp, adv, topk_lp, sampler_topk):
    """Per-token, per-candidate loop of l_t = -A (sg(w(y)) log pi~(y) - sum_v sg(mu(v) w(v)) log pi~(v))."""
    out = []
    for t in range(len(lp)):
        rho = math.exp(lp[t].item() - slp[t].item())
        w_y = rho if C_MIN <= rho <= C_MAX else 0.0
        term = w_y * lp[t]
        for j in range(topk_lp.shape[1]):
            lpv, mu_lp = topk_lp[t, j].item(), sampler_topk[t, j].item()
            if math.isinf(lpv) or math.isinf(mu_lp):
                continue
            rho_v = math.exp(lpv - mu_lp)
            w_v = rho_v if C_MIN <= rho_v <= C_MAX else 0.0
            term = term - math.exp(mu_lp) * w_v * topk_lp[t, j]
        out.append(-adv[t] * term)
    return torch.stack(out)


def test_importance_ratio_and_mask():
    lp = torch.log(torch.tensor([0.1, 0.2, 0.3, 0.4]))
    slp = torch.log(torch.tensor([0.4, 0.2, 0.05, 0.01]))
    ratio = importance_ratio(lp, slp)
    torch.testing.assert_close(ratio, torch.tensor([0.25, 1.0, 6.0, 40.0]))
    assert importance_mask(ratio, C_MIN, C_MAX).tolist() == [False, True, False, False]
    assert importance_mask(torch.tensor([0.5, 5.0, float("nan")]), C_MIN, C_MAX).tolist() == [
        True,
        True,
        False,
    ]


def test_clipped_surrogate_matches_per_token_loop_values_and_grads():
    lp, slp, adv, *_ = _batch()
    got = clipped_surrogate_token_loss(
        lp, slp, adv, epsilon=EPS, epsilon_high=EPS_HIGH, is_clip_min=C_MIN, is_clip_max=C_MAX
    )
    want = _clipped_reference(lp, slp, adv)
    torch.testing.assert_close(got, want)
    (g_got,) = torch.autograd.grad(got.sum(), lp)
    (g_want,) = torch.autograd.grad(want.sum(), lp)
    torch.testing.assert_close(g_got, g_want)


def test_clipped_surrogate_gradient_per_branch():
    lp, slp, adv, *_ = _batch()
    loss = clipped_surrogate_token_loss(
        lp, slp, adv, epsilon=EPS, epsilon_high=EPS_HIGH, is_clip_min=C_MIN, is_clip_max=C_MAX
    )
    (grad,) = torch.autograd.grad(loss.sum(), lp)
    rho = torch.exp(lp - slp).detach()
    masked = (rho < C_MIN) | (rho > C_MAX)
    cut = ((adv > 0) & (rho > 1 + EPS_HIGH)) | ((adv < 0) & (rho < 1 - EPS))
    assert masked.any() and cut.any() and (~masked & ~cut).any()
    assert torch.all(grad[masked] == 0)
    assert torch.all(grad[cut] == 0)
    live = ~masked & ~cut
    torch.testing.assert_close(grad[live], -adv[live] * rho[live])  # d(-rho A)/d log pi~ = -rho A


def test_score_centering_matches_per_token_loop_values_and_grads():
    lp, slp, adv, topk_lp, s_topk, _ = _batch(1)
    got = score_centering_token_loss(lp, slp, adv, topk_lp, s_topk, is_clip_min=C_MIN, is_clip_max=C_MAX)
    want = _centering_reference(lp, slp, adv, topk_lp, s_topk)
    torch.testing.assert_close(got, want)
    g_got = torch.autograd.grad(got.sum(), [lp, topk_lp])
    g_want = torch.autograd.grad(want.sum(), [lp, topk_lp], allow_unused=True)
    torch.testing.assert_close(g_got[0], g_want[0])
    assert torch.all(torch.isfinite(g_got[1]))
    # The loop never touches non-finite entries (no gradient); the loss must give them exactly zero.
    want_topk = torch.where(torch.isfinite(topk_lp.detach()) & torch.isfinite(s_topk), g_want[1], 0.0)
    torch.testing.assert_close(g_got[1], want_topk)


def test_score_centering_masked_sampled_token_keeps_only_the_centering_term():
    lp, slp, adv, topk_lp, s_topk, _ = _batch(2)
    loss = score_centering_token_loss(lp, slp, adv, topk_lp, s_topk, is_clip_min=C_MIN, is_clip_max=C_MAX)
    g_lp, g_topk = torch.autograd.grad(loss.sum(), [lp, topk_lp])
    rho = torch.exp(lp - slp).detach()
    masked = (rho < C_MIN) | (rho > C_MAX)
    assert masked.any()
    assert torch.all(g_lp[masked] == 0)
    torch.testing.assert_close(g_lp[~masked], -adv[~masked] * rho[~masked])
    # Masked top-K entries (columns 0 and 1 are out of [C_MIN, C_MAX]) get no gradient either.
    assert torch.all(g_topk[:, :2] == 0)


def test_overflowing_ratio_is_masked_without_nan_gradients():
    lp = torch.tensor([0.0, -1.0], dtype=torch.float32, requires_grad=True)
    slp = torch.tensor([-200.0, -1.0])  # exp(200) overflows fp32
    adv = torch.tensor([1.0, 1.0])
    for fn in (
        lambda: clipped_surrogate_token_loss(
            lp, slp, adv, epsilon=EPS, epsilon_high=EPS, is_clip_min=C_MIN, is_clip_max=C_MAX
        ),
        lambda: score_centering_token_loss(
            lp, slp, adv, lp[:, None], slp[:, None], is_clip_min=C_MIN, is_clip_max=C_MAX
        ),
    ):
        loss = fn()
        (grad,) = torch.autograd.grad(loss.sum(), lp)
        assert torch.all(torch.isfinite(loss)) and torch.all(torch.isfinite(grad))
        assert grad[0] == 0


@pytest.mark.parametrize("score_centering", [False, True])
def test_normalisation_by_global_token_count_and_accumulation_steps(score_centering):
    lp, slp, adv, topk_lp, s_topk, idx = _batch(3)
    n = len(lp)
    kwargs = {
        "score_centering": score_centering,
        "epsilon": EPS,
        "epsilon_high": EPS_HIGH,
        "is_clip_min": C_MIN,
        "is_clip_max": C_MAX,
    }
    ref = (
        _centering_reference(lp, slp, adv, topk_lp, s_topk)
        if score_centering
        else _clipped_reference(lp, slp, adv)
    )

    def part(sl, global_count, ga):
        return policy_loss(
            lp[sl],
            slp[sl],
            adv[sl],
            idx[sl],
            topk_logprobs=topk_lp[sl],
            sampler_topk_logprobs=s_topk[sl],
            num_trained_tokens_global=global_count,
            gradient_accumulation_steps=ga,
            **kwargs,
        ).loss

    # One process: the per-token mean over all trained tokens (IS-masked tokens stay in the count).
    torch.testing.assert_close(part(slice(None), n, 1), ref.sum() / n)
    # Two processes of one micro-batch, each dividing by the global count: their sum is that mean.
    split = 7
    two = part(slice(0, split), n, 1) + part(slice(split, None), torch.tensor(n), 1)
    torch.testing.assert_close(two, ref.sum() / n)
    g_two = torch.autograd.grad(two, [lp, topk_lp], allow_unused=True)
    g_ref = torch.autograd.grad(ref.sum() / n, [lp, topk_lp], allow_unused=True)
    torch.testing.assert_close(g_two[0], g_ref[0])
    if score_centering:
        finite = torch.isfinite(topk_lp.detach()) & torch.isfinite(s_topk)
        torch.testing.assert_close(g_two[1], torch.where(finite, g_ref[1], 0.0))
    # Two accumulation steps (micro-batches of different sizes): the step is the mean of their means.
    ga = part(slice(0, split), split, 2) + part(slice(split, None), n - split, 2)
    torch.testing.assert_close(ga, 0.5 * (ref[:split].sum() / split + ref[split:].sum() / (n - split)))


def test_policy_loss_errors_name_the_fix():
    lp, slp, adv, topk_lp, s_topk, idx = _batch(4)
    with pytest.raises(ValueError, match="num_sampler_logprobs"):
        policy_loss(lp, slp, adv, idx, num_trained_tokens_global=len(lp), gradient_accumulation_steps=1)
    with pytest.raises(ValueError, match="all-reduced"):
        policy_loss(
            lp,
            slp,
            adv,
            idx,
            num_trained_tokens_global=3,
            gradient_accumulation_steps=1,
            topk_logprobs=topk_lp,
            sampler_topk_logprobs=s_topk,
        )


def test_empty_micro_batch_gives_zero_loss_and_nan_metrics():
    empty = torch.zeros(0, requires_grad=True)
    out = policy_loss(
        empty,
        torch.zeros(0),
        torch.zeros(0),
        torch.zeros(0, dtype=torch.long),
        num_trained_tokens_global=0,
        gradient_accumulation_steps=1,
        topk_logprobs=torch.zeros(0, 3),
        sampler_topk_logprobs=torch.zeros(0, 3),
    )
    assert out.loss.item() == 0.0 and out.loss.requires_grad
    assert all(math.isnan(v) for v in loss_metrics(out.stats).values())


# ---- score-centering properties, through the real log-prob path (hidden = logits, W = identity) ----


def _full_vocab_token_losses(logits, mu_log, advantage, score_centering, ys):
    """Per-token losses of tokens y in `ys`, all predicted from the same logits, with H_t = vocabulary."""
    vocab = logits.shape[-1]
    n = len(ys)
    out = token_logprobs(
        logits[None],
        torch.eye(vocab, dtype=logits.dtype),
        torch.zeros(n, dtype=torch.long),
        ys,
        topk_ids=torch.arange(vocab).expand(n, vocab),
    )
    slp = mu_log[ys]
    adv = torch.full((n,), advantage, dtype=logits.dtype)
    if score_centering:
        return score_centering_token_loss(
            out.target_logprobs,
            slp,
            adv,
            out.topk_logprobs,
            mu_log.expand(n, vocab),
            is_clip_min=C_MIN,
            is_clip_max=C_MAX,
        )
    return clipped_surrogate_token_loss(
        out.target_logprobs,
        slp,
        adv,
        epsilon=EPS,
        epsilon_high=EPS_HIGH,
        is_clip_min=C_MIN,
        is_clip_max=C_MAX,
    )


def test_centering_term_has_zero_gradient_when_pi_equals_mu_over_the_full_vocabulary():
    g = torch.Generator().manual_seed(5)
    vocab = 12
    logits = torch.randn(vocab, generator=g, dtype=torch.float64, requires_grad=True)
    mu_log = torch.log_softmax(logits.detach(), dim=0)
    ys = torch.arange(vocab)
    loss = _full_vocab_token_losses(logits, mu_log, 1.7, True, ys)
    for y in range(vocab):
        (grad,) = torch.autograd.grad(loss[y], logits, retain_graph=True)
        # With pi = mu (w = 1) the centering term sum_v pi(v) grad log pi(v) = grad sum_v pi(v) = 0, so the
        # per-token gradient is the plain policy gradient -A grad log pi(y) = -A (onehot(y) - pi).
        want = -1.7 * (torch.nn.functional.one_hot(torch.tensor(y), vocab) - mu_log.exp())
        torch.testing.assert_close(grad, want)


@pytest.mark.parametrize("advantage", [1.0, -1.0])
def test_constant_advantage_expected_update_does_not_pull_toward_the_sampler(advantage):
    g = torch.Generator().manual_seed(6)
    vocab = 10
    mu_log = torch.log_softmax(torch.randn(vocab, generator=g, dtype=torch.float64), dim=0)
    # pi differs from mu by log-ratios that cross the trust region and the IS mask on both sides.
    shift = torch.tensor([-1.0, -0.5, -0.3, -0.1, 0.0, 0.1, 0.3, 0.6, 1.2, 2.0], dtype=torch.float64)
    logits = (mu_log + shift).detach().requires_grad_()
    pi = torch.softmax(logits.detach(), dim=0)
    mu = mu_log.exp()
    rho = pi / mu
    assert (rho > C_MAX).any() or (rho < C_MIN).any()
    ys = torch.arange(vocab)

    def expected_gradient(score_centering):
        # Exact expectation over y ~ mu: weight each sampled token's loss by mu(y).
        losses = _full_vocab_token_losses(logits, mu_log, advantage, score_centering, ys)
        (grad,) = torch.autograd.grad((mu * losses).sum(), logits)
        return grad

    centered = expected_gradient(True)
    torch.testing.assert_close(centered, torch.zeros_like(centered), atol=1e-12, rtol=0)
    plain = expected_gradient(False)
    assert plain.norm() > 1e-2
    # d KL(mu || pi) / d logits = pi - mu; a step along -plain lowers KL(mu || pi): it moves pi toward mu.
    assert float(torch.dot(pi - mu, plain)) > 1e-3


# ---- metrics ----


def test_metrics_on_a_hand_made_example():
    # Two samples (0: tokens 0-2, 1: tokens 3-4); ratios chosen by hand.
    ratio = torch.tensor([0.7, 1.0, 1.5, 6.0, 0.4], dtype=torch.float64)
    slp = torch.log(torch.tensor([0.5, 0.2, 0.1, 0.05, 0.5], dtype=torch.float64))
    lp = slp + ratio.log()
    adv = torch.tensor([-1.0, -1.0, -1.0, 2.0, 2.0], dtype=torch.float64)
    entropy = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0])
    s_topk = torch.log(
        torch.tensor([[0.5, 0.3], [0.2, 0.1], [0.6, 0.2], [0.9, 0.0], [0.5, 0.25]], dtype=torch.float64)
    )
    out = policy_loss(
        lp,
        slp,
        adv,
        torch.tensor([0, 0, 0, 1, 1]),
        num_trained_tokens_global=5,
        gradient_accumulation_steps=1,
        topk_logprobs=lp[:, None].expand(5, 2),
        sampler_topk_logprobs=s_topk,
        entropy=entropy,
    )
    m = loss_metrics(out.stats)
    diffs = ratio.log().abs()
    assert m["sampling/sampling_logp_difference/mean"] == pytest.approx(float(diffs.mean()))
    assert m["sampling/sampling_logp_difference/max"] == pytest.approx(math.log(6.0))
    assert m["sampling/importance_sampling_ratio/min"] == pytest.approx(0.4)
    assert m["sampling/importance_sampling_ratio/mean"] == pytest.approx(9.6 / 5)
    assert m["sampling/importance_sampling_ratio/max"] == pytest.approx(6.0)
    assert m["sampling/masked_mean"] == pytest.approx(2 / 5)  # 6.0 and 0.4
    assert m["sampling/sampler_mass"] == pytest.approx((0.8 + 0.3 + 0.8 + 0.9 + 0.75) / 5)
    assert m["entropy"] == pytest.approx(3.0)
    # Score centering clips nothing: clip_ratio/* count the tokens outside the trust region
    # [0.8, 1.2] whatever the advantage's sign. low: tokens 0 and 4; high: tokens 2 and 3.
    # Per completion: low 1/3 and 1/2, high 1/3 and 1/2.
    assert m["clip_ratio/low_mean"] == pytest.approx(2 / 5)
    assert m["clip_ratio/high_mean"] == pytest.approx(2 / 5)
    assert m["clip_ratio/region_mean"] == pytest.approx(4 / 5)
    assert m["clip_ratio/low_min"] == pytest.approx(1 / 3)
    assert m["clip_ratio/high_max"] == pytest.approx(0.5)

    plain = policy_loss(
        lp,
        slp,
        adv,
        torch.tensor([0, 0, 0, 1, 1]),
        num_trained_tokens_global=5,
        gradient_accumulation_steps=1,
        score_centering=False,
    )
    metrics = loss_metrics(plain.stats)
    assert "sampling/sampler_mass" not in metrics and "entropy" not in metrics
    # The clipped surrogate cuts the gradient of low tokens with A < 0 and high tokens with A > 0:
    # low token 0 (token 4 has A > 0), high token 3 (token 2 has A < 0). Per completion: low 1/3
    # and 0/2, high 0/3 and 1/2.
    assert metrics["clip_ratio/low_mean"] == pytest.approx(1 / 5)
    assert metrics["clip_ratio/high_mean"] == pytest.approx(1 / 5)
    assert metrics["clip_ratio/region_mean"] == pytest.approx(2 / 5)
    assert metrics["clip_ratio/low_min"] == pytest.approx(0.0)
    assert metrics["clip_ratio/high_max"] == pytest.approx(0.5)


def test_merged_micro_batch_stats_equal_the_stats_of_the_whole_batch():
    lp, slp, adv, topk_lp, s_topk, idx = _batch(7, n=32)
    entropy = torch.rand(32, generator=torch.Generator().manual_seed(0))

    def stats(sl):
        return policy_loss(
            lp[sl],
            slp[sl],
            adv[sl],
            idx[sl],
            num_trained_tokens_global=32,
            gradient_accumulation_steps=1,
            topk_logprobs=topk_lp[sl],
            sampler_topk_logprobs=s_topk[sl],
            entropy=entropy[sl],
        ).stats

    whole = loss_metrics(stats(slice(None)))
    # Split at a sample boundary (5 tokens per sample), as packing never splits a sample across rows.
    merged = loss_metrics(merge_loss_stats(stats(slice(0, 15)), stats(slice(15, None))))
    assert whole.keys() == merged.keys()
    for key in whole:
        assert merged[key] == pytest.approx(whole[key]), key
