"""Trainer log-probs of the trained tokens, from final hidden states, in bounded memory.

This module owns the step from the model's last hidden states to the per-token quantities the loss
needs: `log pi~(y)` of each trained token, `log pi~(v)` of the sampler's top-K tokens (for score
centering) and the entropy of the trainer's distribution (a metric). Everything is pure: explicit
tensors in, tensors out.

Definitions (DESIGN.md section 4), for a trained token n predicted by packed position `pred_index[n]`:

    x = (hidden[pred_index[n]] @ W^T (+ b)) * scale       raw logits, [V]
    z = cap * tanh(x / cap) / temperature                 processed logits (no tanh without cap)
    log pi(v)  = z_v - logsumexp_{u in V} z_u
    log pi~(v) = log pi(v) - logsumexp_{u in S} log pi(u) = z_v - logsumexp_{u in S} z_u

`scale` is the model's own logit multiplier (Cohere's `logit_scale`, 1 / Granite's `logits_scaling`,
1 elsewhere: `asyncgrpo.train.model_setup.logit_processing`), and `S` is the server's candidate set
after top-k / top-p (the whole vocabulary when none is given, for the row or for one token -- an
empty CSR range --, then `pi~ = pi`). Top-K tokens outside `S` (probability zero under `pi~`) and
pad entries (id -1) get `-inf`. The entropy is that of `pi` (temperature-scaled, full vocabulary)
and carries no gradient.

Memory: full-vocabulary logits are never built for the whole row. The N trained positions are
selected first and processed `chunk_size` rows at a time; a custom autograd function keeps only the
selected hidden rows and one logsumexp per row, and recomputes each chunk's logits in backward (the
same idea as a fused linear cross-entropy). Peak extra memory is a few `[chunk_size, V]` fp32 buffers
plus, in backward, one fp32 `[V, H]` buffer that accumulates the LM-head gradient.

Precision: the matmuls run in the LM-head weight's dtype (autocast is disabled inside, hidden states
are cast to that dtype); everything after the matmul (softcap, temperature, logsumexp, softmax,
gradients w.r.t. logits) is fp32, and the LM-head gradient is accumulated over chunks in fp32.

`fused=True` (rows without candidate sets) runs the elementwise work after each chunk's matmul as
the fusable reduction and pointwise map of `asyncgrpo.train.logprob_epilogue` (compiled on CUDA):
the same values, without the full-size fp32 passes; the dense part of the logit gradient is rounded
to the weight's dtype once, the target and top-K terms are added in fp32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from asyncgrpo.train import logprob_epilogue as epilogue

__all__ = ["TokenLogprobs", "token_logprobs", "token_logprobs_reference"]


@dataclass(frozen=True)
class TokenLogprobs:
    """Per-trained-token outputs of `token_logprobs`.

    Attributes:
        target_logprobs: `[N]` fp32, `log pi~(y_n)` of the trained token; differentiable.
        topk_logprobs: `[N, K]` fp32, `log pi~(v)` of the sampler's top-K tokens, `-inf` for pad
            entries and tokens outside the candidate set; differentiable. None when no top-K ids
            were given.
        entropy: `[N]` fp32, entropy (nats) of the temperature-scaled full-vocabulary `pi`; no grad.

    All three are fp64 instead when the LM-head weight is fp64 (exact tests).
    """

    target_logprobs: Tensor
    topk_logprobs: Tensor | None
    entropy: Tensor


def _check_inputs(
    hidden: Tensor,
    lm_head_weight: Tensor,
    pred_index: Tensor,
    target_ids: Tensor,
    temperature: float,
    topk_ids: Tensor | None,
    candidate_ids: Tensor | None,
    candidate_offsets: Tensor | None,
) -> None:
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 to compute log-probs, got {temperature}.")
    if hidden.dim() != 2 or lm_head_weight.dim() != 2 or hidden.shape[1] != lm_head_weight.shape[1]:
        raise ValueError(
            f"Expected hidden [T, H] and lm_head_weight [V, H] with the same H, got "
            f"{tuple(hidden.shape)} and {tuple(lm_head_weight.shape)}."
        )
    if pred_index.shape != target_ids.shape or pred_index.dim() != 1:
        raise ValueError(
            f"pred_index and target_ids must both be [N], got {tuple(pred_index.shape)} and "
            f"{tuple(target_ids.shape)}."
        )
    if topk_ids is not None and (topk_ids.dim() != 2 or topk_ids.shape[0] != target_ids.shape[0]):
        raise ValueError(
            f"topk_ids must be [N, K] with N={target_ids.shape[0]}, got {tuple(topk_ids.shape)}."
        )
    if (candidate_ids is None) != (candidate_offsets is None):
        raise ValueError(
            "Pass candidate_ids and candidate_offsets together (or neither for the full vocabulary)."
        )
    if candidate_offsets is not None and candidate_offsets.shape != (target_ids.shape[0] + 1,):
        raise ValueError(
            f"candidate_offsets must be [N + 1] = [{target_ids.shape[0] + 1}], "
            f"got {tuple(candidate_offsets.shape)}."
        )


def _acc_dtype(weight: Tensor) -> torch.dtype:
    """Accumulation dtype: fp32, or fp64 for fp64 weights (exact tests)."""
    return torch.promote_types(weight.dtype, torch.float32)


def _raw_logits(h: Tensor, weight: Tensor, bias: Tensor | None, scale: float) -> Tensor:
    """`(h @ W^T (+ b)) * scale` with the matmul in the weight's dtype, returned in the accumulation
    dtype, `[C, V]`."""
    x = F.linear(h.to(weight.dtype), weight, bias).to(_acc_dtype(weight))
    return x * scale if scale != 1.0 else x


def _process(x: Tensor, temperature: float, softcap: float | None) -> Tensor:
    """Raw (scaled) fp32 logits -> processed logits `z = cap * tanh(x / cap) / temperature`."""
    if softcap is not None:
        x = torch.tanh(x / softcap) * softcap
    return x / temperature


def _candidate_mask(
    start: int, stop: int, vocab_size: int, cand_rows: Tensor, cand_ids: Tensor, offsets: list[int], device
) -> Tensor:
    """Boolean `[stop - start, V]` membership mask of the candidate sets of rows `start:stop`.

    A row with an empty range has no candidate set: its mask is the whole vocabulary (a real set
    always holds the sampled token, so it is never empty)."""
    lo, hi = offsets[start], offsets[stop]
    no_set = torch.tensor([offsets[i] == offsets[i + 1] for i in range(start, stop)], device=device)
    mask = no_set[:, None].expand(stop - start, vocab_size).clone()
    mask[cand_rows[lo:hi] - start, cand_ids[lo:hi]] = True
    return mask


class _ChunkedLogprobs(torch.autograd.Function):
    """Chunked log-softmax gather with logits recomputed in backward (see the module docstring).

    Inputs: selected hidden rows `h [N, H]`, weight `[V, H]`, bias `[V] | None`, targets `[N]`,
    top-K ids `[N, K]` (K may be 0), candidate CSR (`cand_rows`, `cand_ids`, `offsets` or None).
    Outputs: target log-probs `[N]`, top-K log-probs `[N, K]`, entropy `[N]` (non-differentiable).
    """

    @staticmethod
    def forward(
        ctx,
        h,
        weight,
        bias,
        target_ids,
        topk_ids,
        cand_rows,
        cand_ids,
        offsets,
        temperature,
        scale,
        softcap,
        chunk_size,
        fused,
    ):
        n, vocab_size = h.shape[0], weight.shape[0]
        device = h.device
        k = topk_ids.shape[1]
        topk_valid = topk_ids >= 0
        safe_topk = topk_ids.clamp(min=0)
        acc = _acc_dtype(weight)
        lse = torch.empty(n, dtype=acc, device=device)
        target_lp = torch.empty(n, dtype=acc, device=device)
        topk_lp = torch.empty(n, k, dtype=acc, device=device)
        entropy = torch.empty(n, dtype=acc, device=device)
        fused = fused and offsets is None
        with torch.autocast(device_type=device.type, enabled=False):
            if fused:
                epilogue.forward_chunks(h, weight, bias, target_ids, safe_topk, temperature, scale, softcap,
                                        chunk_size, lse, target_lp, topk_lp, entropy)
            for start in range(0, 0 if fused else n, chunk_size):  # the plain path
                stop = min(start + chunk_size, n)
                z = _process(_raw_logits(h[start:stop], weight, bias, scale), temperature, softcap)
                lse_full = torch.logsumexp(z, dim=-1)
                probs = torch.exp(z - lse_full[:, None])
                entropy[start:stop] = lse_full - (probs * z).sum(dim=-1)
                del probs
                if offsets is None:
                    lse_set = lse_full
                else:
                    in_set = _candidate_mask(start, stop, vocab_size, cand_rows, cand_ids, offsets, device)
                    lse_set = torch.logsumexp(z.masked_fill(~in_set, float("-inf")), dim=-1)
                    topk_valid[start:stop] &= in_set.gather(1, safe_topk[start:stop])
                    del in_set
                lse[start:stop] = lse_set
                target_lp[start:stop] = z.gather(1, target_ids[start:stop, None]).squeeze(1) - lse_set
                if k:
                    topk_lp[start:stop] = z.gather(1, safe_topk[start:stop]) - lse_set[:, None]
                del z
        topk_lp = topk_lp.masked_fill(~topk_valid, float("-inf"))
        ctx.save_for_backward(h, weight, bias, target_ids, safe_topk, topk_valid, lse, cand_rows, cand_ids)
        ctx.offsets = offsets
        ctx.temperature = temperature
        ctx.scale = scale
        ctx.softcap = softcap
        ctx.chunk_size = chunk_size
        ctx.fused = fused
        ctx.mark_non_differentiable(entropy)
        return target_lp, topk_lp, entropy

    @staticmethod
    def backward(ctx, grad_target, grad_topk, _grad_entropy):
        h, weight, bias, target_ids, safe_topk, topk_valid, lse, cand_rows, cand_ids = ctx.saved_tensors
        offsets, temperature, scale, softcap = ctx.offsets, ctx.temperature, ctx.scale, ctx.softcap
        need_h, need_w, need_b = ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.needs_input_grad[2]
        n, vocab_size = h.shape[0], weight.shape[0]
        device, acc = h.device, _acc_dtype(weight)
        if grad_target is None:
            grad_target = torch.zeros(n, dtype=acc, device=device)
        if grad_topk is None:
            grad_topk = torch.zeros(safe_topk.shape, dtype=acc, device=device)
        grad_target = grad_target.to(acc)
        # -inf outputs (pad / outside the candidate set) are constants: drop any gradient sent to them.
        grad_topk = torch.where(topk_valid, grad_topk.to(acc), 0.0)
        grad_row = grad_target + grad_topk.sum(dim=-1)

        grad_h = torch.empty_like(h) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=acc, device=device) if need_w else None
        grad_b = torch.zeros(vocab_size, dtype=acc, device=device) if need_b and bias is not None else None
        with torch.autocast(device_type=device.type, enabled=False):
            if ctx.fused:
                epilogue.backward_chunks(h, weight, bias, target_ids, safe_topk, lse, grad_row, grad_target,
                                         grad_topk, temperature, scale, softcap, ctx.chunk_size, grad_h,
                                         grad_w, grad_b)
            for start in range(0, 0 if ctx.fused else n, ctx.chunk_size):  # the plain path
                stop = min(start + ctx.chunk_size, n)
                x = _raw_logits(h[start:stop], weight, bias, scale)
                z = _process(x, temperature, softcap)
                if offsets is not None:
                    in_set = _candidate_mask(start, stop, vocab_size, cand_rows, cand_ids, offsets, device)
                    z = z.masked_fill(~in_set, float("-inf"))
                    del in_set
                # d/dz of (z_v - lse_S(z)) is onehot(v) - softmax_S(z); sum over every output of the row.
                grad_z = torch.exp(z - lse[start:stop, None]).mul_(-grad_row[start:stop, None])
                del z
                grad_z.scatter_add_(1, target_ids[start:stop, None], grad_target[start:stop, None])
                grad_z.scatter_add_(1, safe_topk[start:stop], grad_topk[start:stop])
                if softcap is not None:
                    grad_z.mul_(1.0 - torch.tanh(x / softcap).square_())
                del x
                grad_x = grad_z.mul_(scale / temperature)  # d/d(h @ W^T + b), through scale and temperature
                if need_h:
                    grad_h[start:stop] = (grad_x.to(weight.dtype) @ weight).to(h.dtype)
                if need_w:
                    grad_w += (grad_x.t().to(weight.dtype) @ h[start:stop].to(weight.dtype)).to(acc)
                if grad_b is not None:
                    grad_b += grad_x.sum(dim=0)
                del grad_x
        grad_w = grad_w.to(weight.dtype) if grad_w is not None else None
        grad_b = grad_b.to(bias.dtype) if grad_b is not None else None
        return grad_h, grad_w, grad_b, None, None, None, None, None, None, None, None, None, None


def token_logprobs(
    hidden: Tensor,
    lm_head_weight: Tensor,
    pred_index: Tensor,
    target_ids: Tensor,
    *,
    temperature: float = 1.0,
    lm_head_bias: Tensor | None = None,
    logit_scale: float = 1.0,
    logit_softcapping: float | None = None,
    topk_ids: Tensor | None = None,
    candidate_ids: Tensor | None = None,
    candidate_offsets: Tensor | None = None,
    chunk_size: int = 1024,
    fused: bool = False,
) -> TokenLogprobs:
    """Log-probs of the trained tokens (and the sampler's top-K tokens) under the trainer's policy.

    Args:
        hidden: `[T, H]` final hidden states of one packed row (last norm already applied).
        lm_head_weight: `[V, H]` LM-head (output embedding) weight.
        pred_index: `[N]` int64, packed position whose hidden state predicts trained token n.
        target_ids: `[N]` int64, trained token ids.
        temperature: sampling temperature; logits are divided by it (after softcapping).
        lm_head_bias: optional `[V]` LM-head bias.
        logit_scale: the model's own factor on `hidden @ W^T (+ b)` (Cohere's `logit_scale`,
            1 / Granite's `logits_scaling`), applied before softcapping.
        logit_softcapping: optional final logit softcap (`cap * tanh(x / cap)`), e.g. Gemma-2's.
        topk_ids: optional `[N, K]` int64, the sampler's top-K token ids, pad id -1.
        candidate_ids: optional flat int64 candidate-set token ids (CSR values), row by row.
        candidate_offsets: optional `[N + 1]` int64 CSR offsets into `candidate_ids`; with None for
            both, the candidate set is the full vocabulary; a token whose range is empty has none.
        chunk_size: rows processed at once; peak memory grows with `chunk_size * V`.
        fused: run the elementwise work after each chunk's matmul as the fused kernels of
            `asyncgrpo.train.logprob_epilogue` (compiled on CUDA); rows with candidate sets keep the
            plain path.

    Returns:
        `TokenLogprobs` with fp32 `target_logprobs [N]`, `topk_logprobs [N, K] | None`, `entropy [N]`.
        Gradients flow to `hidden`, `lm_head_weight` and `lm_head_bias`.
    """
    _check_inputs(
        hidden,
        lm_head_weight,
        pred_index,
        target_ids,
        temperature,
        topk_ids,
        candidate_ids,
        candidate_offsets,
    )
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}.")
    device = hidden.device
    n = target_ids.shape[0]
    h = hidden.index_select(0, pred_index)
    topk = topk_ids if topk_ids is not None else torch.empty(n, 0, dtype=torch.long, device=device)
    if candidate_offsets is not None:
        counts = candidate_offsets[1:] - candidate_offsets[:-1]
        cand_rows = torch.repeat_interleave(torch.arange(n, device=device), counts)
        offsets = candidate_offsets.tolist()  # one host sync; chunk boundaries need host ints
        cand_ids = candidate_ids
    else:
        cand_rows = cand_ids = offsets = None
    target_lp, topk_lp, entropy = _ChunkedLogprobs.apply(
        h,
        lm_head_weight,
        lm_head_bias,
        target_ids,
        topk,
        cand_rows,
        cand_ids,
        offsets,
        float(temperature),
        float(logit_scale),
        logit_softcapping,
        chunk_size,
        fused,
    )
    return TokenLogprobs(target_lp, topk_lp if topk_ids is not None else None, entropy)


def token_logprobs_reference(
    hidden: Tensor,
    lm_head_weight: Tensor,
    pred_index: Tensor,
    target_ids: Tensor,
    *,
    temperature: float = 1.0,
    lm_head_bias: Tensor | None = None,
    logit_scale: float = 1.0,
    logit_softcapping: float | None = None,
    topk_ids: Tensor | None = None,
    candidate_ids: Tensor | None = None,
    candidate_offsets: Tensor | None = None,
) -> TokenLogprobs:
    """Plain reference for `token_logprobs`: full `[N, V]` logits and ordinary autograd.

    Same arguments and results as `token_logprobs` (without chunking); meant for tests and debugging,
    its memory is O(N * V) in forward and backward.
    """
    _check_inputs(
        hidden,
        lm_head_weight,
        pred_index,
        target_ids,
        temperature,
        topk_ids,
        candidate_ids,
        candidate_offsets,
    )
    n, vocab_size = target_ids.shape[0], lm_head_weight.shape[0]
    z = _process(
        _raw_logits(hidden[pred_index], lm_head_weight, lm_head_bias, logit_scale), temperature,
        logit_softcapping,
    )
    log_pi = torch.log_softmax(z, dim=-1)
    entropy = -(log_pi.exp() * log_pi).sum(dim=-1).detach()
    if candidate_offsets is None:
        in_set = torch.ones(n, vocab_size, dtype=torch.bool, device=z.device)
    else:
        counts = candidate_offsets[1:] - candidate_offsets[:-1]
        rows = torch.repeat_interleave(torch.arange(n, device=z.device), counts)
        in_set = (counts == 0)[:, None].expand(n, vocab_size).clone()  # empty range: no set
        in_set[rows, candidate_ids] = True
    log_norm = torch.logsumexp(log_pi.masked_fill(~in_set, float("-inf")), dim=-1, keepdim=True)
    log_pi_set = log_pi - log_norm
    target_lp = log_pi_set.gather(1, target_ids[:, None]).squeeze(1)
    topk_lp = None
    if topk_ids is not None:
        safe = topk_ids.clamp(min=0)
        valid = (topk_ids >= 0) & in_set.gather(1, safe)
        topk_lp = log_pi_set.gather(1, safe).masked_fill(~valid, float("-inf"))
    return TokenLogprobs(target_lp, topk_lp, entropy)
