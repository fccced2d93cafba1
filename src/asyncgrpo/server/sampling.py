"""Sampling math of the embedded server: pure, batched functions over the running sequences.

Order of processing for every row (vLLM's order with `--logprobs-mode processed_logprobs`):

    logits -> repetition penalty / bans -> temperature -> min_p -> top_k -> top_p -> processed log-probs
           -> sample (greedy at temperature 0, else a seeded exponential race)

Definitions (the invariants the tests check against a plain loop):
- Tokens are ordered by processed logit, descending, ties broken by the LOWER token id. Every filter
  keeps a prefix of that order, so the candidate set of a row is a prefix of it:
  min_p keeps `logit >= max_logit + log(min_p)`; top_k keeps the first k tokens (exactly k, ties at
  the boundary resolved by id); top_p keeps a token when the probability mass strictly before it,
  renormalised over what min_p and top_k kept, is `< top_p`.
- Processed log-probs are the log-softmax over the candidates; excluded tokens are `-inf`.
- Temperature 0 means greedy (argmax, lowest id on ties); its log-probs are taken at temperature 1.
- Randomness is a counter-based hash of (seed, output position, token id) mapped to a uniform `u`;
  the sampled token is `argmax_j log p_j - log(-log u_j)` over the candidates (Gumbel-max, the same
  as vLLM's exponential race). It does not depend on batching or on the other rows.
- The rank of the sampled token is the number of tokens whose processed log-prob is `>=` its own
  (vLLM's definition); the top-k list uses positional ranks 1..k.

No I/O, clock, logging or globals; host-side facts that choose the code path (how many sorted
columns are needed) travel in `SamplingBatch` as Python ints so the functions never synchronise.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

_M32 = 0xFFFFFFFF
_NEG_INF = float("-inf")


@dataclass(frozen=True)
class SamplingBatch:
    """Per-row sampling parameters of one step (all tensors on the logits' device, length B)."""

    temperature: torch.Tensor  # float32; 0 = greedy
    top_k: torch.Tensor  # int64; 0 = off
    top_p: torch.Tensor  # float32 in (0, 1]
    min_p: torch.Tensor  # float32 in [0, 1]
    row_hashes: torch.Tensor  # int64: `row_hash` of each row's seed and the output index being drawn
    num_sorted: int  # columns of the sorted candidate list; 0 = no sort, >= vocab = full sort
    num_top_logprobs: int  # K of the top-K log-prob list (max over rows)
    mask_width: int  # columns of the candidate-id output (max top_k over rows that want masks)
    all_top_k: bool  # every row has top_k > 0, so all candidates lie in the sorted columns
    token_hashes: torch.Tensor  # [V] int64: `token_hash` of every token id (the same for every step)


@dataclass(frozen=True)
class SamplingPlan:
    """Host side of one step's sampling: the per-row parameters and the shape of the work."""

    floats: np.ndarray  # [3, B] float32 rows: temperature, top_p, min_p
    ints: np.ndarray  # [2, B] int64 rows: top_k, `row_hash` of the seed and output index
    num_sorted: int  # see SamplingBatch
    num_top_logprobs: int
    mask_width: int
    all_top_k: bool

    def batch(self, floats: torch.Tensor, ints: torch.Tensor, token_hashes: torch.Tensor) -> SamplingBatch:
        """The SamplingBatch of this plan over device copies of `floats` and `ints`."""
        return SamplingBatch(
            temperature=floats[0],
            top_p=floats[1],
            min_p=floats[2],
            top_k=ints[0],
            row_hashes=ints[1],
            num_sorted=self.num_sorted,
            num_top_logprobs=self.num_top_logprobs,
            mask_width=self.mask_width,
            all_top_k=self.all_top_k,
            token_hashes=token_hashes,
        )


@dataclass(frozen=True)
class SampleResult:
    """What one step sampled (device tensors)."""

    token_ids: torch.Tensor  # [B] int64
    logprobs: torch.Tensor  # [B] float32, processed log-prob of the sampled token
    ranks: torch.Tensor  # [B] int64, 1-based
    top_ids: torch.Tensor  # [B, K] int64, best first
    top_logprobs: torch.Tensor  # [B, K] float32 (-inf for excluded tokens)
    mask_ids: torch.Tensor  # [B, W] int64, candidate ids ascending, padded with -1
    num_candidates: torch.Tensor  # [B] int64


def pack(res: SampleResult) -> torch.Tensor:
    """One [B, 3 + 2K + W] float64 tensor (token id, log-prob, rank, top-K ids, top-K log-probs,
    candidate ids) so that the step's output reaches the host in a single copy; float64 holds
    every id exactly."""
    return torch.cat(
        [
            res.token_ids[:, None].double(),
            res.logprobs[:, None].double(),
            res.ranks[:, None].double(),
            res.top_ids.double(),
            res.top_logprobs.double(),
            res.mask_ids.double(),
        ],
        dim=1,
    )


def plan_columns(
    top_ks: Sequence[int], top_ps: Sequence[float], num_top_logprobs: int, mask_width: int, vocab_size: int
) -> int:
    """How many sorted columns a batch needs (host-side, from the request parameters; lists or arrays).

    A full sort is needed only when some row restricts by top_p without top_k; otherwise the top
    `max(top_k, K, mask_width)` columns are enough. Rows without top_k and top_p need no sort.
    """
    top_ks, top_ps = np.asarray(top_ks), np.asarray(top_ps)
    if np.any((top_ks <= 0) & (top_ps < 1.0)):
        return vocab_size
    sorted_rows = top_ks[top_ks > 0]
    if sorted_rows.size == 0:
        return 0
    return min(vocab_size, max(int(sorted_rows.max()), num_top_logprobs, mask_width))


def apply_repetition_penalty(logits: torch.Tensor, seen: torch.Tensor, penalty: torch.Tensor) -> torch.Tensor:
    """vLLM/CTRL repetition penalty: for tokens in `seen` ([B, V] bool, prompt or output), divide a
    positive logit by `penalty` ([B]) and multiply a negative one. Returns a new tensor."""
    pen = penalty.to(logits.dtype)[:, None]
    penalised = torch.where(logits > 0, logits / pen, logits * pen)
    return torch.where(seen, penalised, logits)


def sortable_keys(values: torch.Tensor) -> torch.Tensor:
    """Unique int64 keys whose descending order is (value descending, token id ascending).

    values: [B, V] float32. The float's bits are mapped to an int32 that orders like the float (the
    magnitude bits of negative values flipped), then shifted left by 32 bits, and the low bits hold
    `2^32 - 1 - id`.
    """
    assert values.dtype == torch.float32, values.dtype
    bits = values.contiguous().view(torch.int32)
    ordered = (bits ^ ((bits >> 31) & 0x7FFFFFFF)).to(torch.int64)
    ids = torch.arange(values.shape[-1], device=values.device, dtype=torch.int64)
    return (ordered << 32) | (_M32 - ids)


def _mul32(h, c: int):
    """(h * c) mod 2^32 for 0 <= h < 2^32 without int64 overflow (16-bit halves); torch or numpy int64."""
    return ((h & 0xFFFF) * c + ((((h >> 16) * c) & 0xFFFF) << 16)) & _M32


def _fmix32(h):
    """MurmurHash3's 32-bit finaliser on int64 values in [0, 2^32) (torch or numpy)."""
    h = h ^ (h >> 16)
    h = _mul32(h, 0x85EBCA6B)
    h = h ^ (h >> 13)
    h = _mul32(h, 0xC2B2AE35)
    return h ^ (h >> 16)


def seed_hash(seeds):
    """Per-seed part of the hash: int64 seeds (torch or numpy, any shape) -> values in [0, 2^32)."""
    return _fmix32(_fmix32((seeds & _M32) ^ 0x243F6A88) ^ ((seeds >> 32) & _M32))


def token_hash(token_ids):
    """Per-token part of the hash: int64 ids (torch or numpy, any shape) -> values in [0, 2^32)."""
    return _fmix32(_mul32(token_ids & _M32, 0x9E3779B1) ^ 0x03707344)


def row_hash(seed_hashes, positions):
    """Per-draw part of the hash: `seed_hash` values and output positions (torch or numpy int64, [B])."""
    return _fmix32(seed_hashes ^ (positions & _M32) ^ 0x13198A2E)


def hashed_uniform(row_hashes: torch.Tensor, token_hashes: torch.Tensor) -> torch.Tensor:
    """`hash_uniform` from precomputed `row_hash` [B] and `token_hash` ([B, N] or [N]) values."""
    if token_hashes.dim() == 1:
        token_hashes = token_hashes[None, :]
    h = _fmix32(row_hashes[:, None] ^ token_hashes)
    return ((h >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 24))


def hash_uniform(seeds: torch.Tensor, positions: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """Uniform numbers in (0, 1), a pure function of (seed, position, token id).

    seeds, positions: [B] int64; token_ids: [B, N] or [N] int64. Returns [B, N] float32 with 24
    random bits each.
    """
    return hashed_uniform(row_hash(seed_hash(seeds), positions), token_hash(token_ids))


def sample(logits: torch.Tensor, batch: SamplingBatch) -> SampleResult:
    """Process logits ([B, V], any float dtype) and draw one token per row; see the module docstring.

    When every row's candidates lie in its `num_sorted` best tokens (every row has top_k > 0, or the
    batch is fully sorted), all work after the partial sort runs on those columns only; otherwise
    (some rows keep the whole vocabulary) on the full rows.
    """
    v = logits.shape[1]
    greedy = batch.temperature <= 0
    temperature = torch.where(greedy, torch.ones_like(batch.temperature), batch.temperature)
    scaled = logits.float() / temperature[:, None]
    keys = sortable_keys(scaled)
    ncol = min(batch.num_sorted, v)
    if ncol >= v or (ncol > 0 and batch.all_top_k):
        return _sample_sorted_columns(scaled, keys, ncol, greedy, batch)
    return _sample_vocabulary(scaled, keys, ncol, greedy, batch)


def _sample_sorted_columns(
    scaled: torch.Tensor, keys: torch.Tensor, ncol: int, greedy: torch.Tensor, batch: SamplingBatch
) -> SampleResult:
    """Every candidate set is a prefix of the row's `ncol` best tokens: work on those columns."""
    v = scaled.shape[1]
    ids = keys.sort(dim=-1, descending=True).indices if ncol >= v else keys.topk(ncol, dim=-1).indices
    vals = scaled.gather(1, ids)  # [B, C], descending
    keep = sorted_candidates(vals, batch.top_k, batch.top_p, batch.min_p)
    masked = vals.masked_fill(~keep, _NEG_INF)
    lp = masked - torch.logsumexp(masked, dim=-1, keepdim=True)
    pick = _draw(ids, lp, greedy, batch)
    token_lp = lp.gather(1, pick)
    k, w = batch.num_top_logprobs, batch.mask_width
    return SampleResult(
        token_ids=ids.gather(1, pick).squeeze(1),
        logprobs=token_lp.squeeze(1),
        ranks=(lp >= token_lp).sum(dim=-1),
        top_ids=ids[:, :k],
        top_logprobs=lp[:, :k],
        mask_ids=_candidate_ids(ids[:, :w], keep[:, :w], v),
        num_candidates=keep.sum(dim=-1),
    )


def _sample_vocabulary(
    scaled: torch.Tensor, keys: torch.Tensor, ncol: int, greedy: torch.Tensor, batch: SamplingBatch
) -> SampleResult:
    """Some rows keep candidates outside the sorted columns: masks and log-probs over the vocabulary.

    Rows restricted by top_k/top_p find their last candidate in the `ncol` sorted columns and keep
    every token whose key is at least its key.
    """
    b, v = scaled.shape
    device = scaled.device
    keep = scaled > _NEG_INF
    top = scaled.max(dim=-1, keepdim=True).values
    keep &= scaled >= top + torch.log(batch.min_p)[:, None]
    order = None
    if ncol > 0:
        sorted_keys, order = keys.topk(ncol, dim=-1)
        prefix = sorted_candidates(scaled.gather(1, order), batch.top_k, batch.top_p, batch.min_p)
        count = prefix.sum(dim=-1, keepdim=True)
        threshold = sorted_keys.gather(1, (count - 1).clamp(min=0))
        restricted = (batch.top_k > 0) | (batch.top_p < 1.0)
        keep &= (keys >= threshold) | ~restricted[:, None]

    masked = scaled.masked_fill(~keep, _NEG_INF)
    lp = masked - torch.logsumexp(masked, dim=-1, keepdim=True)
    token_ids = _draw(torch.arange(v, device=device), lp, greedy, batch)
    token_lp = lp.gather(1, token_ids)

    k, w = batch.num_top_logprobs, batch.mask_width
    if k > 0:
        top_ids = order[:, :k] if order is not None and order.shape[1] >= k else keys.topk(k, dim=-1).indices
    else:
        top_ids = torch.empty(b, 0, dtype=torch.int64, device=device)
    if w > 0:
        assert order is not None and order.shape[1] >= w, "mask rows need top_k > 0 (see plan_columns)"
        mask_ids = _candidate_ids(order[:, :w], keep.gather(1, order[:, :w]), v)
    else:
        mask_ids = torch.empty(b, 0, dtype=torch.int64, device=device)
    return SampleResult(
        token_ids=token_ids.squeeze(1),
        logprobs=token_lp.squeeze(1),
        ranks=(lp >= token_lp).sum(dim=-1),
        top_ids=top_ids,
        top_logprobs=lp.gather(1, top_ids),
        mask_ids=mask_ids,
        num_candidates=keep.sum(dim=-1),
    )


def sorted_candidates(
    vals: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor
) -> torch.Tensor:
    """Candidate mask [B, C] over values sorted descending per row ([B, C] float32, the row's best
    first): finite, min_p, then top_k (0 = off) and top_p. Always a prefix of each row."""
    ncol = vals.shape[1]
    keep = vals > _NEG_INF
    keep &= vals >= vals[:, :1] + torch.log(min_p)[:, None]
    cols = torch.arange(ncol, device=vals.device)
    k_eff = torch.where(top_k > 0, top_k, torch.full_like(top_k, ncol))
    keep &= cols[None, :] < k_eff[:, None]
    probs = torch.softmax(vals.masked_fill(~keep, _NEG_INF), dim=-1)
    before = probs.cumsum(dim=-1) - probs
    keep &= (before < top_p[:, None]) | (top_p[:, None] >= 1.0)
    return keep


def _draw(
    cand_ids: torch.Tensor, cand_lp: torch.Tensor, greedy: torch.Tensor, batch: SamplingBatch
) -> torch.Tensor:
    """Column [B, 1] of the drawn token among the candidates (cand_ids [B, C] or [C], log-probs [B, C]):
    the seeded exponential race, or the first best column for greedy rows."""
    u = hashed_uniform(batch.row_hashes, batch.token_hashes[cand_ids])
    race = cand_lp - torch.log(-torch.log(u))
    score = torch.where(greedy[:, None], cand_lp, race)
    return score.argmax(dim=-1, keepdim=True)


def _candidate_ids(ids: torch.Tensor, keep: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Kept ids of each row ([B, W] ids and mask) ascending, padded with -1."""
    ids = torch.where(keep, ids, torch.full_like(ids, vocab_size)).sort(dim=-1).values
    return torch.where(ids == vocab_size, torch.full_like(ids, -1), ids)
