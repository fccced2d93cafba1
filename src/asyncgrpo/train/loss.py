"""The policy loss of asynchronous GRPO and its metrics (DESIGN.md section 4); pure functions.

Per trained token t with advantage `A`, trainer log-prob `log pi~(y_t)` (candidate-set renormalised,
see `train/logprobs.py`) and sampler log-prob `log mu(y_t)`:

    rho_t = exp(log pi~(y_t) - log mu(y_t))                       importance ratio
    m_t   = 1[C_min <= rho_t <= C_max]                            IS mask, no gradient

- Clipped surrogate (`score_centering=False`):
      l_t = -m_t * min(rho_t * A, clip(rho_t, 1 - eps, 1 + eps_high) * A)
- Score centering (`score_centering=True`, the default), over the sampler's top-K set H_t:
      w(v) = rho(v) * 1[C_min <= rho(v) <= C_max],   rho(v) = exp(log pi~(v) - log mu(v))
      l_t  = -A * ( sg(w(y_t)) * log pi~(y_t) - sum_{v in H_t} sg(mu(v) * w(v)) * log pi~(v) )
  The mask acts per token inside `w`: a masked sampled token loses its own term, the centering sum
  keeps every in-range v of H_t. That sum is the expectation of the first term under the sampler
  (`E_{y~mu}[w(y) grad log pi~(y)]`, restricted to H_t), so dropping it whenever y_t happens to be
  masked would bias the estimator and re-introduce the pull toward the sampler that centering removes.

Normalisation: `loss = sum_t l_t / num_trained_tokens_global / gradient_accumulation_steps`, so
summing the returned losses over the micro-batches of a step and over processes gives the step's
per-token mean. The caller (the trainer) must pass `num_trained_tokens_global`, the number of trained
tokens of this micro-batch summed over ALL processes (an all-reduce SUM of each process's N; IS-masked
tokens are counted). Under DDP/FSDP, which AVERAGE gradients over the W processes, the trainer must
multiply this loss by W before backward (as transformers' Trainer does with
`average_tokens_across_devices`), and must not divide by the accumulation steps a second time.

Metrics come back as `LossStats`: sums, minima and maxima that reduce exactly across micro-batches
(`merge_loss_stats`) and processes (all-reduce SUM / MIN / MAX per dict), then `loss_metrics` turns
them into the seed's metric names. `clip_ratio/*`: with the clipped surrogate a token is "low" when
`rho_t < 1 - eps` and `A < 0`, "high" when `rho_t > 1 + eps_high` and `A > 0` (the tokens on which
its gradient is cut, TRL GRPO's convention); with score centering nothing is clipped, and they count
the tokens outside the trust region, "low" when `rho_t < 1 - eps`, "high" when `rho_t > 1 + eps_high`,
whatever the advantage. "region" is either; means are over trained tokens (IS-masked included);
`low_min` / `high_max` are the extreme per-completion fractions (a completion's trained tokens may
span several samples when a multi-turn rollout forked; grouped by `completion_index`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from asyncgrpo import metrics as M

__all__ = [
    "LossStats",
    "PolicyLoss",
    "add_router_aux_loss",
    "clipped_surrogate_token_loss",
    "importance_mask",
    "importance_ratio",
    "loss_metrics",
    "merge_loss_stats",
    "policy_loss",
    "score_centering_token_loss",
]


def _acc(t: Tensor) -> Tensor:
    """`t` in the accumulation dtype: fp32, or fp64 when given fp64."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


def importance_ratio(logprobs: Tensor, sampler_logprobs: Tensor) -> Tensor:
    """`rho = exp(log pi~ - log mu)`, fp32 (fp64 if given), same shape; differentiable via `logprobs`."""
    return torch.exp(_acc(logprobs) - _acc(sampler_logprobs))


def importance_mask(ratio: Tensor, clip_min: float, clip_max: float) -> Tensor:
    """Masked importance sampling: boolean `C_min <= ratio <= C_max` (no gradient; NaN -> False)."""
    ratio = ratio.detach()
    return (ratio >= clip_min) & (ratio <= clip_max)


def _masked_ratio(
    logprobs: Tensor, sampler_logprobs: Tensor, clip_min: float, clip_max: float
) -> tuple[Tensor, Tensor]:
    """`(rho * m, m)` with a NaN-free gradient: masked entries are computed from a zero log-ratio.

    `torch.where` alone would leak `0 * inf` into the gradient of an overflowing `exp`.
    """
    log_ratio = _acc(logprobs) - _acc(sampler_logprobs)
    mask = importance_mask(torch.exp(log_ratio.detach()), clip_min, clip_max)
    safe = torch.where(mask, log_ratio, torch.zeros_like(log_ratio))
    return torch.where(mask, torch.exp(safe), torch.zeros_like(safe)), mask


def clipped_surrogate_token_loss(
    logprobs: Tensor,
    sampler_logprobs: Tensor,
    advantages: Tensor,
    *,
    epsilon: float,
    epsilon_high: float,
    is_clip_min: float,
    is_clip_max: float,
) -> Tensor:
    """Per-token `l_t = -m_t * min(rho_t * A, clip(rho_t, 1 - eps, 1 + eps_high) * A)`, `[N]` fp32.

    Args:
        logprobs: `[N]` trainer `log pi~(y_t)`, differentiable.
        sampler_logprobs: `[N]` sampler `log mu(y_t)`.
        advantages: `[N]` per-token advantage (the sample's).
        epsilon, epsilon_high: trust region `[1 - epsilon, 1 + epsilon_high]`.
        is_clip_min, is_clip_max: IS mask bounds `C_min`, `C_max`.
    """
    ratio, mask = _masked_ratio(logprobs, sampler_logprobs, is_clip_min, is_clip_max)
    adv = _acc(advantages)
    clipped = torch.clamp(ratio, 1.0 - epsilon, 1.0 + epsilon_high)
    surrogate = torch.minimum(ratio * adv, clipped * adv)
    return -torch.where(mask, surrogate, torch.zeros_like(surrogate))


def score_centering_token_loss(
    logprobs: Tensor,
    sampler_logprobs: Tensor,
    advantages: Tensor,
    topk_logprobs: Tensor,
    sampler_topk_logprobs: Tensor,
    *,
    is_clip_min: float,
    is_clip_max: float,
) -> Tensor:
    """Per-token score-centering loss (module docstring), `[N]` fp32.

    Args:
        logprobs, sampler_logprobs, advantages: `[N]` as in `clipped_surrogate_token_loss`.
        topk_logprobs: `[N, K]` trainer `log pi~(v)` of the sampler's top-K tokens, differentiable;
            `-inf` where v is a pad entry or outside the candidate set.
        sampler_topk_logprobs: `[N, K]` sampler `log mu(v)` of the same tokens, `-inf` for pads.
        is_clip_min, is_clip_max: IS mask bounds `C_min`, `C_max`, applied per token v.

    Entries where either log-prob is not finite contribute nothing (`mu(v) = 0` or `pi~(v) = 0`).
    """
    w_target, _ = _masked_ratio(logprobs, sampler_logprobs, is_clip_min, is_clip_max)
    sampled_term = w_target.detach() * _acc(logprobs)

    topk_lp = _acc(topk_logprobs)
    valid = torch.isfinite(topk_lp) & torch.isfinite(sampler_topk_logprobs)
    topk_lp_safe = torch.where(valid, topk_lp, torch.zeros_like(topk_lp))
    ratio_v = torch.exp(topk_lp_safe.detach() - torch.where(valid, _acc(sampler_topk_logprobs), 0.0))
    keep = valid & importance_mask(ratio_v, is_clip_min, is_clip_max)
    # mu(v) * w(v) = mu(v) * rho(v) = pi~(v) on kept entries; computed as exp(log pi~) to avoid inf * 0.
    coef = torch.where(keep, topk_lp_safe.detach().exp(), torch.zeros_like(topk_lp_safe))
    centering_term = (coef * topk_lp_safe).sum(dim=-1)
    return -_acc(advantages) * (sampled_term - centering_term)


@dataclass(frozen=True)
class LossStats:
    """Metric statistics of one or more micro-batches, reducible exactly.

    Attributes:
        sums: 0-d fp32 tensors to add up (across micro-batches: `merge_loss_stats`; across
            processes: all-reduce SUM). Keys: `num_trained_tokens`, and `<metric>/sum` or
            `<metric>/count` for each mean metric.
        mins: 0-d tensors to reduce with MIN (`+inf` when empty).
        maxs: 0-d tensors to reduce with MAX (`-inf` when empty).
    """

    sums: dict[str, Tensor]
    mins: dict[str, Tensor]
    maxs: dict[str, Tensor]


@dataclass(frozen=True)
class PolicyLoss:
    """Result of `policy_loss`: the scalar loss to backpropagate and its metric statistics."""

    loss: Tensor
    stats: LossStats


def _per_completion_extremes(flags: Tensor, completion_index: Tensor) -> tuple[Tensor, Tensor]:
    """Min and max over completions of the per-completion fraction of flagged tokens (`+inf` / `-inf`
    if empty)."""
    if flags.numel() == 0:
        inf = torch.tensor(float("inf"), device=flags.device)
        return inf, -inf
    _, inverse = torch.unique(completion_index, return_inverse=True)
    num_tokens = torch.bincount(inverse).float()
    num_flagged = torch.bincount(inverse, weights=flags.float())
    fraction = num_flagged / num_tokens
    return fraction.min(), fraction.max()


def _loss_stats(
    logprobs: Tensor,
    sampler_logprobs: Tensor,
    advantages: Tensor,
    completion_index: Tensor,
    score_centering: bool,
    sampler_topk_logprobs: Tensor | None,
    entropy: Tensor | None,
    epsilon: float,
    epsilon_high: float,
    is_clip_min: float,
    is_clip_max: float,
) -> LossStats:
    lp, slp, adv = logprobs.detach().float(), sampler_logprobs.float(), advantages.float()
    zero = torch.zeros((), dtype=torch.float32, device=lp.device)
    inf = torch.tensor(float("inf"), device=lp.device)
    ratio = importance_ratio(lp, slp)
    logp_diff = (slp - lp).abs()
    masked_out = ~importance_mask(ratio, is_clip_min, is_clip_max)
    low = ratio < 1.0 - epsilon
    high = ratio > 1.0 + epsilon_high
    if not score_centering:  # the clipped surrogate cuts the gradient only on these
        low, high = low & (adv < 0), high & (adv > 0)
    low_min, _ = _per_completion_extremes(low, completion_index)
    _, high_max = _per_completion_extremes(high, completion_index)
    sums = {
        "num_trained_tokens": torch.tensor(float(lp.numel()), device=lp.device),
        "sampling/sampling_logp_difference/sum": logp_diff.sum(),
        "sampling/importance_sampling_ratio/sum": ratio.sum(),
        "sampling/masked/count": masked_out.float().sum(),
        "clip_ratio/region/count": (low | high).float().sum(),
        "clip_ratio/low/count": low.float().sum(),
        "clip_ratio/high/count": high.float().sum(),
    }
    if entropy is not None:
        sums["entropy/sum"] = entropy.detach().float().sum()
    if sampler_topk_logprobs is not None:
        sums["sampling/sampler_mass/sum"] = sampler_topk_logprobs.float().exp().sum() if lp.numel() else zero
    mins = {
        "sampling/importance_sampling_ratio/min": ratio.min() if lp.numel() else inf,
        "clip_ratio/low_min": low_min,
    }
    maxs = {
        "sampling/sampling_logp_difference/max": logp_diff.max() if lp.numel() else -inf,
        "sampling/importance_sampling_ratio/max": ratio.max() if lp.numel() else -inf,
        "clip_ratio/high_max": high_max,
    }
    return LossStats(sums, mins, maxs)


def policy_loss(
    logprobs: Tensor,
    sampler_logprobs: Tensor,
    advantages: Tensor,
    completion_index: Tensor,
    *,
    num_trained_tokens_global: int | Tensor,
    gradient_accumulation_steps: int,
    score_centering: bool = True,
    topk_logprobs: Tensor | None = None,
    sampler_topk_logprobs: Tensor | None = None,
    entropy: Tensor | None = None,
    epsilon: float = 0.2,
    epsilon_high: float | None = None,
    is_clip_min: float = 0.5,
    is_clip_max: float = 5.0,
) -> PolicyLoss:
    """The micro-batch loss of one process and its metric statistics.

    Args:
        logprobs: `[N]` trainer `log pi~(y_t)` of this process's trained tokens, differentiable.
        sampler_logprobs: `[N]` sampler `log mu(y_t)`.
        advantages: `[N]` advantage of each token's sample.
        completion_index: `[N]` int, which completion (rollout) each token belongs to; used for the
            per-completion `clip_ratio/low_min` and `clip_ratio/high_max`.
        num_trained_tokens_global: trained tokens of this micro-batch summed over all processes
            (int or 0-d tensor from an all-reduce); IS-masked tokens count.
        gradient_accumulation_steps: micro-batches per optimizer step.
        score_centering: score-centering objective (True) or clipped surrogate (False).
        topk_logprobs: `[N, K]` trainer `log pi~(v)` of the sampler's top-K (score centering).
        sampler_topk_logprobs: `[N, K]` sampler `log mu(v)`, `-inf` pads (score centering).
        entropy: optional `[N]` entropy of pi, for the `entropy` metric.
        epsilon, epsilon_high: trust region (`epsilon_high=None` means `epsilon`).
        is_clip_min, is_clip_max: `vllm_importance_sampling_clip_min/max`.

    Returns:
        `PolicyLoss(loss, stats)`: `loss = sum_t l_t / num_trained_tokens_global /
        gradient_accumulation_steps` (0-d fp32), `stats` for `loss_metrics`.
    """
    epsilon_high = epsilon if epsilon_high is None else epsilon_high
    if gradient_accumulation_steps < 1:
        raise ValueError(f"gradient_accumulation_steps must be >= 1, got {gradient_accumulation_steps}.")
    if not 0 <= is_clip_min <= is_clip_max:
        raise ValueError(
            f"Need 0 <= vllm_importance_sampling_clip_min <= vllm_importance_sampling_clip_max, got "
            f"{is_clip_min} and {is_clip_max}."
        )
    n = logprobs.shape[0]
    if isinstance(num_trained_tokens_global, int) and num_trained_tokens_global < n:
        raise ValueError(
            f"num_trained_tokens_global={num_trained_tokens_global} is smaller than this process's {n} "
            "trained tokens; pass the all-reduced (SUM) count over all processes."
        )
    if score_centering:
        if topk_logprobs is None or sampler_topk_logprobs is None:
            raise ValueError(
                "score_centering=True needs the sampler's top-K log-probs (topk_logprobs and "
                "sampler_topk_logprobs); set num_sampler_logprobs > 0, or score_centering=False."
            )
        if topk_logprobs.shape != sampler_topk_logprobs.shape or topk_logprobs.shape[0] != n:
            raise ValueError(
                f"topk_logprobs {tuple(topk_logprobs.shape)} and sampler_topk_logprobs "
                f"{tuple(sampler_topk_logprobs.shape)} must both be [N={n}, K]."
            )
        token_loss = score_centering_token_loss(
            logprobs,
            sampler_logprobs,
            advantages,
            topk_logprobs,
            sampler_topk_logprobs,
            is_clip_min=is_clip_min,
            is_clip_max=is_clip_max,
        )
    else:
        token_loss = clipped_surrogate_token_loss(
            logprobs,
            sampler_logprobs,
            advantages,
            epsilon=epsilon,
            epsilon_high=epsilon_high,
            is_clip_min=is_clip_min,
            is_clip_max=is_clip_max,
        )
    if isinstance(num_trained_tokens_global, Tensor):
        denominator = num_trained_tokens_global.float().clamp(min=1.0)
    else:
        denominator = float(max(num_trained_tokens_global, 1))
    loss = token_loss.sum() / denominator / gradient_accumulation_steps
    with torch.no_grad():
        stats = _loss_stats(
            logprobs,
            sampler_logprobs,
            advantages,
            completion_index,
            score_centering,
            sampler_topk_logprobs if score_centering else None,
            entropy,
            epsilon,
            epsilon_high,
            is_clip_min,
            is_clip_max,
        )
    return PolicyLoss(loss, stats)


def add_router_aux_loss(
    result: PolicyLoss, aux_loss: Tensor, *, coef: float, gradient_accumulation_steps: int, num_processes: int
) -> PolicyLoss:
    """`result` with a Mixture-of-Experts load-balancing loss added: `coef * aux_loss` averaged over the
    micro-batches of a step and over processes (the trainer multiplies the loss by `num_processes`
    before data-parallel averaging, as for the policy loss). `aux_loss` (the model's own, 0-d) is also
    kept in the stats for the `aux_loss` metric, before scaling."""
    loss = result.loss + coef * aux_loss.float() / (gradient_accumulation_steps * num_processes)
    sums = {**result.stats.sums, "aux_loss/sum": aux_loss.detach().float(),
            "aux_loss/count": torch.ones((), device=aux_loss.device)}
    return PolicyLoss(loss, LossStats(sums, result.stats.mins, result.stats.maxs))


def merge_loss_stats(a: LossStats, b: LossStats) -> LossStats:
    """Combine the statistics of two micro-batches (sum / min / max per key)."""
    return LossStats(
        sums={k: a.sums[k] + b.sums[k] for k in a.sums},
        mins={k: torch.minimum(a.mins[k], b.mins[k]) for k in a.mins},
        maxs={k: torch.maximum(a.maxs[k], b.maxs[k]) for k in a.maxs},
    )


def loss_metrics(stats: LossStats) -> dict[str, float]:
    """Final metric values (seed names) from fully reduced statistics; NaN when there were no tokens."""
    s = {k: float(v) for k, v in stats.sums.items()}
    count = s["num_trained_tokens"]

    def mean(key: str) -> float:
        return s[key] / count if count > 0 else float("nan")

    def extreme(value: Tensor) -> float:
        return float(value) if count > 0 else float("nan")

    metrics = {
        M.SAMPLING_LOGP_DIFFERENCE_MEAN: mean("sampling/sampling_logp_difference/sum"),
        M.SAMPLING_LOGP_DIFFERENCE_MAX: extreme(stats.maxs["sampling/sampling_logp_difference/max"]),
        M.SAMPLING_IS_RATIO_MIN: extreme(
            stats.mins["sampling/importance_sampling_ratio/min"]
        ),
        M.SAMPLING_IS_RATIO_MEAN: mean("sampling/importance_sampling_ratio/sum"),
        M.SAMPLING_IS_RATIO_MAX: extreme(
            stats.maxs["sampling/importance_sampling_ratio/max"]
        ),
        M.SAMPLING_MASKED_MEAN: mean("sampling/masked/count"),
        M.CLIP_RATIO_REGION_MEAN: mean("clip_ratio/region/count"),
        M.CLIP_RATIO_LOW_MEAN: mean("clip_ratio/low/count"),
        M.CLIP_RATIO_LOW_MIN: extreme(stats.mins["clip_ratio/low_min"]),
        M.CLIP_RATIO_HIGH_MEAN: mean("clip_ratio/high/count"),
        M.CLIP_RATIO_HIGH_MAX: extreme(stats.maxs["clip_ratio/high_max"]),
    }
    if "sampling/sampler_mass/sum" in s:
        metrics[M.SAMPLING_SAMPLER_MASS] = mean("sampling/sampler_mass/sum")
    if "entropy/sum" in s:
        metrics[M.ENTROPY] = mean("entropy/sum")
    if "aux_loss/sum" in s:  # per micro-batch, not per token
        metrics[M.AUX_LOSS] = (s["aux_loss/sum"] / s["aux_loss/count"] if s["aux_loss/count"] > 0
                               else float("nan"))
    return metrics
