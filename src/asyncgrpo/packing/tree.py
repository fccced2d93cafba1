"""Tree packing: training samples -> one row, a prefix trie laid out depth first.

This module owns the data that crosses from the rollout process to the trainer (`Sample`) and the
layout of one packed row (`PackedRow`). Everything here is pure (numpy in, torch tensors out).

Layout (DESIGN 5, the seed's "Empaquetado de arboles")::

    r0: p1 p2 p3 a1 a2          S0 [p1 p2] -+- S1 [p3 a1 a2]
    r1: p1 p2 p3 b1 b2                      +- S2 [p3 b1 b2]

    index         0  1 | 2  3  4 | 5  6  7
    input_ids     p1 p2| p3 a1 a2| p3 b1 b2
    position_ids  0  1 | 2  3  4 | 2  3  4
    pred_index    r0: a1 a2 -> 2 3    r1: b1 b2 -> 5 6

Invariants of a row:
- a position predicts exactly one next token: two samples share a token at depth d only if they
  also agree on the token at depth d + 1, or one of them ends at d (the trie forks ONE token before
  the divergence, so `p3` above is not shared);
- segments are numbered in depth-first (pre-)order and children attach at the END of their parent
  segment, so the subtree of segment s occupies the packed range
  `[segment_start[s], segment_subtree_end[s])` and token j is visible from token i iff
  `j <= i < segment_subtree_end[segment_ids[j]]`;
- `position_ids` are trie depths, so each token sees the same positions as in its own sample;
- children are ordered by the first sample (in input order) that reaches them, so a row of
  samples that share nothing is plain padding-free packing in input order;
- every trained token keeps its own target and data, duplicated samples included (their
  predicting positions coincide).

How: samples are sorted lexicographically (big-endian bytes compare like token tuples, in C), the
shareable length of sorted neighbours gives the trie (like a suffix tree from an LCP array), one
stack pass finds where each sample's new tokens attach, and the layout is numpy concatenation.
Cost is O(sum of lengths) numpy work plus O(n log n) byte comparisons for n samples.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Sequence
from dataclasses import InitVar, dataclass, field

import numpy as np
import torch

__all__ = [
    "PackedRow",
    "Sample",
    "concat_ranges",
    "pack_row",
    "sample_paths",
    "shared_prefix_len",
    "sort_key",
    "unpack_token_ids",
]

TopKPerToken = Sequence[Sequence[tuple[int, float]] | dict[int, float] | None]
CandidatesPerToken = Sequence[Sequence[int] | None]


@dataclass(frozen=True, eq=False)
class Sample:
    """One training sample: a token sequence whose generated tokens are trained.

    Stored as numpy arrays (cheap to pickle: a 2k-token sample with top-20 sampler log-probs is a
    few hundred KB of raw buffers instead of ~100k Python objects). Lists or tuples are accepted and
    converted. Equality is identity (arrays have no single truth value); compare fields instead.

    Per-token fields have length L = len(token_ids):
        token_ids: int32 [L], context + generated tokens, ids >= 0.
        trained_mask: bool [L], True for trained (generated) tokens; position 0 cannot be trained
            (nothing predicts it).
        sampler_logprobs: float32 [L], the sampler's log-prob of each token (0.0 where not trained).
        advantage: the rollout's advantage, shared by all its trained tokens.
        group_id: the prompt group (the batcher keeps a group in one row to share its prompt).
        sampler_topk: init-only, per token None or the sampler's top-K as ((id, logprob), ...) or
            {id: logprob} (`TrainingSequence.sampler_top_logprobs`). Converted to `topk_ids` /
            `topk_logprobs`.
        candidate_sets: init-only, per token None or ascending candidate ids. Converted to
            `candidate_ids` / `candidate_offsets`.
        topk_ids / topk_logprobs: int32 / float32 [L, K] sampler top-K, padded with -1 / -inf.
        candidate_ids / candidate_offsets: CSR, candidates of token t are
            candidate_ids[candidate_offsets[t]:candidate_offsets[t + 1]]; an empty range means
            "no candidate set" (no renormalisation), since a real set always holds the sampled token.
    """

    token_ids: np.ndarray
    trained_mask: np.ndarray
    sampler_logprobs: np.ndarray
    advantage: float
    group_id: int
    sampler_topk: InitVar[TopKPerToken | None] = None
    candidate_sets: InitVar[CandidatesPerToken | None] = None
    model_version: int = 0
    rollout_id: str = ""
    topk_ids: np.ndarray | None = None
    topk_logprobs: np.ndarray | None = None
    candidate_ids: np.ndarray | None = None
    candidate_offsets: np.ndarray | None = None

    def __post_init__(self, sampler_topk: TopKPerToken | None, candidate_sets: CandidatesPerToken | None):
        def put(name: str, value) -> None:
            object.__setattr__(self, name, value)

        tokens = np.asarray(self.token_ids)
        if tokens.ndim != 1 or tokens.size == 0:
            raise ValueError(f"Sample.token_ids must be a non-empty 1-D sequence, got shape {tokens.shape}")
        if tokens.dtype.kind not in "iu" or tokens.min() < 0 or tokens.max() > np.iinfo(np.int32).max:
            raise ValueError("Sample.token_ids must be integer token ids in [0, 2**31)")
        tokens = tokens.astype(np.int32, copy=False)
        length = tokens.size
        put("token_ids", tokens)
        put("trained_mask", _per_token(self.trained_mask, np.bool_, length, "trained_mask"))
        if self.trained_mask[0]:
            raise ValueError("Sample.trained_mask[0] is True, but no position predicts the first token; "
                             "start every sample with at least one context token")
        put("sampler_logprobs", _per_token(self.sampler_logprobs, np.float32, length, "sampler_logprobs"))
        put("advantage", float(self.advantage))
        put("group_id", int(self.group_id))

        if sampler_topk is not None:
            if self.topk_ids is not None:
                raise ValueError("give the sampler top-K either as sampler_topk or as topk_ids/topk_logprobs")
            ids, logprobs = _topk_to_arrays(sampler_topk, length)
            put("topk_ids", ids)
            put("topk_logprobs", logprobs)
        if (self.topk_ids is None) != (self.topk_logprobs is None):
            raise ValueError("Sample.topk_ids and Sample.topk_logprobs must be given together")
        if self.topk_ids is not None:
            ids = np.asarray(self.topk_ids, dtype=np.int32)
            logprobs = np.asarray(self.topk_logprobs, dtype=np.float32)
            if ids.ndim != 2 or ids.shape[0] != length or ids.shape != logprobs.shape:
                raise ValueError(f"Sample.topk_ids/topk_logprobs must both be [L={length}, K], "
                                 f"got {ids.shape} and {logprobs.shape}")
            put("topk_ids", ids)
            put("topk_logprobs", logprobs)

        if candidate_sets is not None:
            if self.candidate_ids is not None:
                raise ValueError("give candidates either as candidate_sets or as candidate_ids/offsets")
            ids, offsets = _candidates_to_csr(candidate_sets, length)
            put("candidate_ids", ids)
            put("candidate_offsets", offsets)
        if (self.candidate_ids is None) != (self.candidate_offsets is None):
            raise ValueError("Sample.candidate_ids and Sample.candidate_offsets must be given together")
        if self.candidate_ids is not None:
            ids = np.asarray(self.candidate_ids, dtype=np.int32).reshape(-1)
            offsets = np.asarray(self.candidate_offsets, dtype=np.int64)
            if offsets.shape != (length + 1,) or offsets[0] != 0 or offsets[-1] != ids.size:
                raise ValueError(f"Sample.candidate_offsets must be [L + 1 = {length + 1}] from 0 to "
                                 f"len(candidate_ids) = {ids.size}")
            put("candidate_ids", ids)
            put("candidate_offsets", offsets)
            _check_trained_tokens_in_their_sets(tokens, self.trained_mask, ids, offsets)

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.size)

    @property
    def num_trained(self) -> int:
        return int(np.count_nonzero(self.trained_mask))


def _per_token(values, dtype, length: int, name: str) -> np.ndarray:
    array = np.asarray(values, dtype=dtype)
    if array.shape != (length,):
        raise ValueError(f"Sample.{name} must have one entry per token ({length}), got shape {array.shape}")
    return array


def _topk_to_arrays(sampler_topk: TopKPerToken, length: int) -> tuple[np.ndarray, np.ndarray]:
    if len(sampler_topk) != length:
        raise ValueError(f"Sample.sampler_topk must have one entry per token ({length}), got {len(sampler_topk)}")
    k = max((len(entry) for entry in sampler_topk if entry is not None), default=0)
    ids = np.full((length, k), -1, dtype=np.int32)
    logprobs = np.full((length, k), -np.inf, dtype=np.float32)
    for t, entry in enumerate(sampler_topk):
        if entry:
            items = entry.items() if isinstance(entry, dict) else entry
            pairs = np.asarray(list(items), dtype=np.float64).reshape(-1, 2)
            ids[t, : len(pairs)] = pairs[:, 0]
            logprobs[t, : len(pairs)] = pairs[:, 1]
    return ids, logprobs


def _candidates_to_csr(candidate_sets: CandidatesPerToken, length: int) -> tuple[np.ndarray, np.ndarray]:
    if len(candidate_sets) != length:
        raise ValueError(f"Sample.candidate_sets must have one entry per token ({length}), "
                         f"got {len(candidate_sets)}")
    sizes = np.array([0 if c is None else len(c) for c in candidate_sets], dtype=np.int64)
    offsets = np.zeros(length + 1, dtype=np.int64)
    np.cumsum(sizes, out=offsets[1:])
    chunks = [np.asarray(c, dtype=np.int32) for c in candidate_sets if c]
    ids = np.concatenate(chunks) if chunks else np.zeros(0, dtype=np.int32)
    return ids, offsets


def _check_trained_tokens_in_their_sets(tokens: np.ndarray, trained: np.ndarray, ids: np.ndarray,
                                       offsets: np.ndarray) -> None:
    """A trained token with a candidate set must be in it (the sampler could not have drawn it
    otherwise, and its renormalised log-prob would be meaningless)."""
    sizes = np.diff(offsets)
    checked = trained & (sizes > 0)
    if not checked.any():
        return
    owner = np.repeat(np.arange(tokens.size), sizes)
    hits = np.zeros(tokens.size, dtype=np.int64)
    np.add.at(hits, owner, ids == tokens[owner])
    bad = np.flatnonzero(checked & (hits == 0))
    if bad.size:
        t = int(bad[0])
        raise ValueError(
            f"trained token {int(tokens[t])} at position {t} is not in its candidate set "
            f"{ids[offsets[t]:offsets[t + 1]].tolist()[:8]}{'...' if sizes[t] > 8 else ''} ({bad.size} such tokens "
            "in this sample): the sampler could not have drawn it. A custom generate_one_turn must return, for "
            "each output token, the candidate set it was drawn from in output_sampling_mask (or None for the "
            "full vocabulary)"
        )


def sort_key(token_ids: np.ndarray) -> bytes:
    """Bytes that compare like the tuple of token ids (shorter prefix first)."""
    return token_ids.astype(">u4", copy=False).tobytes()


def shared_prefix_len(a: np.ndarray, b: np.ndarray) -> int:
    """Tokens two sequences can share in a row: the whole shorter one if it is a prefix of the
    other, else their common prefix minus one (the last common token predicts different tokens)."""
    m = min(a.size, b.size)
    diff = np.flatnonzero(a[:m] != b[:m])
    if diff.size == 0:
        return m
    return max(int(diff[0]) - 1, 0)


@dataclass
class PackedRow:
    """One row of a micro-batch: the tree-packed samples of one process.

    T forwarded tokens, S segments, N trained tokens, K sampler top-K. All tensors are on CPU
    (`to(device)` moves them); index tensors are int64.
    """

    input_ids: torch.Tensor  # [T] unique tokens, depth-first trie order
    position_ids: torch.Tensor  # [T] trie depth
    segment_ids: torch.Tensor  # [T] segment of each token
    segment_parent: torch.Tensor  # [S] parent segment, -1 for roots
    segment_start: torch.Tensor  # [S] packed index of the segment's first token
    segment_len: torch.Tensor  # [S]
    segment_subtree_end: torch.Tensor  # [S] packed end (exclusive) of the segment's subtree
    pred_index: torch.Tensor  # [N] packed index whose output predicts the trained token
    target_ids: torch.Tensor  # [N]
    advantages: torch.Tensor  # [N] float32
    sampler_logprobs: torch.Tensor  # [N] float32
    sample_index: torch.Tensor  # [N] which sample (0..num_samples-1) the token belongs to
    completion_index: torch.Tensor  # [N] which completion: samples with the same rollout_id share one
    topk_ids: torch.Tensor | None  # [N, K] int64, pad -1
    topk_logprobs: torch.Tensor | None  # [N, K] float32, pad -inf
    candidate_ids: torch.Tensor | None  # [M] int64
    candidate_offsets: torch.Tensor | None  # [N + 1]; empty range = no candidate set
    sample_last_index: torch.Tensor  # [num_samples] packed index of each sample's last token
    num_samples: int
    num_raw_tokens: int  # sum of sample lengths, before sharing
    group_ids: tuple[int, ...]  # per sample
    model_versions: tuple[int, ...]  # per sample
    rollout_ids: tuple[str, ...] = field(default=())  # per sample

    @property
    def num_tokens(self) -> int:
        """Forwarded (unique) tokens T."""
        return int(self.input_ids.numel())

    @property
    def num_trained(self) -> int:
        return int(self.pred_index.numel())

    @property
    def packing_ratio(self) -> float:
        return self.num_raw_tokens / max(self.num_tokens, 1)

    @property
    def attention_pairs(self) -> int:
        """Attended (query, key) pairs without sliding windows: each token sees depth + 1 keys."""
        return int(self.position_ids.sum()) + self.num_tokens

    def to(self, device: torch.device | str, non_blocking: bool = False) -> PackedRow:
        moved = {}
        for name, value in vars(self).items():
            moved[name] = value.to(device, non_blocking=non_blocking) if isinstance(value, torch.Tensor) else value
        return PackedRow(**moved)


def pack_row(samples: Sequence[Sample], share_prefixes: bool = True) -> PackedRow:
    """Pack samples into one row (see the module docstring for the layout and its invariants).

    `share_prefixes=False` makes every sample its own root segment: ordinary padding-free packing
    on the same attention path (a baseline for benchmarks and debugging).
    """
    if not samples:
        raise ValueError("pack_row needs at least one sample")
    tokens = [s.token_ids for s in samples]
    lengths = np.array([t.size for t in tokens], dtype=np.int64)
    n = len(samples)

    # 1. Sorted order and shareable length with the sorted predecessor.
    order = list(range(n))
    shared = [0] * n
    if share_prefixes:
        keys = [sort_key(t) for t in tokens]
        order.sort(key=keys.__getitem__)
        for k in range(1, n):
            shared[k] = shared_prefix_len(tokens[order[k - 1]], tokens[order[k]])

    # 2. Each sorted sample k adds depths [shared[k], L) of its own tokens (its "chunk"); the chunk
    #    attaches after depth shared[k] - 1 of the chunk that holds it on the predecessor's path.
    #    `path` is that path as a stack of chunks with increasing start depths.
    splits: list[list[int]] = [[] for _ in range(n)]
    attach: list[tuple[int, int] | None] = [None] * n  # chunk k hangs below depth d - 1 of chunk j
    last_owner = [0] * n  # chunk holding the sample's last token
    path: list[int] = []
    for k in range(n):
        start, end = shared[k], int(lengths[order[k]])
        while path and shared[path[-1]] >= start:
            path.pop()
        if start > 0:
            owner = path[-1]
            attach[k] = (owner, start)
            owner_end = int(lengths[order[owner]])
            if start < owner_end:
                splits[owner].append(start)
        if end > start:
            path.append(k)
            last_owner[k] = k
        else:  # a duplicate: its tokens are all on the predecessor's path
            last_owner[k] = path[-1]

    # 3. Segments of each chunk (split where later chunks attach), parents in chunk terms.
    chunk_bounds: list[list[int]] = []
    chunk_first_seg = np.full(n, -1, dtype=np.int64)
    seg_chunk: list[int] = []
    seg_lo: list[int] = []
    seg_hi: list[int] = []
    for k in range(n):
        start, end = shared[k], int(lengths[order[k]])
        bounds = sorted({start, end, *splits[k]})
        chunk_bounds.append(bounds)
        if end > start:
            chunk_first_seg[k] = len(seg_chunk)
            for lo, hi in itertools.pairwise(bounds):
                seg_chunk.append(k)
                seg_lo.append(lo)
                seg_hi.append(hi)

    def segment_at(chunk: int, depth: int) -> int:
        """Segment of `chunk` holding `depth`."""
        return int(chunk_first_seg[chunk]) + bisect.bisect_right(chunk_bounds[chunk], depth) - 1

    num_segments = len(seg_chunk)
    parent = np.full(num_segments, -1, dtype=np.int64)
    for s in range(num_segments):
        k = seg_chunk[s]
        if s > 0 and seg_chunk[s - 1] == k:
            parent[s] = s - 1
        elif attach[k] is not None:
            owner, depth = attach[k]
            parent[s] = segment_at(owner, depth - 1)

    # 4. Depth-first layout with children ordered by the first input sample that reaches them.
    #    Every sample ends at some segment; a segment's key is the smallest input index ending in
    #    its subtree (segments are in sorted preorder here, so children come after parents).
    end_segment = [segment_at(last_owner[k], int(lengths[order[k]]) - 1) for k in range(n)]
    subtree_first = np.full(num_segments, n, dtype=np.int64)
    for k in range(n):
        subtree_first[end_segment[k]] = min(subtree_first[end_segment[k]], order[k])
    for s in range(num_segments - 1, -1, -1):
        p = parent[s]
        if p >= 0 and subtree_first[s] < subtree_first[p]:
            subtree_first[p] = subtree_first[s]
    children: list[list[int]] = [[] for _ in range(num_segments)]
    roots = []
    for s in range(num_segments):
        (children[parent[s]] if parent[s] >= 0 else roots).append(s)
    new_order: list[int] = []
    stack = sorted(roots, key=lambda s: -subtree_first[s])
    while stack:
        s = stack.pop()
        new_order.append(s)
        stack.extend(sorted(children[s], key=lambda c: -subtree_first[c]))
    rank = np.empty(num_segments, dtype=np.int64)
    rank[new_order] = np.arange(num_segments)

    # 5. Token arrays in the new order.
    seg_len = np.array([seg_hi[s] - seg_lo[s] for s in new_order], dtype=np.int64)
    seg_start = np.zeros(num_segments, dtype=np.int64)
    np.cumsum(seg_len[:-1], out=seg_start[1:])
    total = int(seg_len.sum())
    input_ids = np.concatenate([tokens[order[seg_chunk[s]]][seg_lo[s]:seg_hi[s]] for s in new_order])
    depth_lo = np.array([seg_lo[s] for s in new_order], dtype=np.int64)
    segment_ids = np.repeat(np.arange(num_segments), seg_len)
    position_ids = np.arange(total) - np.repeat(seg_start - depth_lo, seg_len)
    new_parent = np.where(parent[new_order] >= 0, rank[np.maximum(parent[new_order], 0)], -1)
    subtree_end = seg_start + seg_len
    for s in range(num_segments - 1, -1, -1):  # children follow their parent in preorder
        p = new_parent[s]
        if p >= 0 and subtree_end[s] > subtree_end[p]:
            subtree_end[p] = subtree_end[s]

    # 6. Per sample: packed index of every depth on its path, then its trained tokens.
    sample_last_segment = np.empty(n, dtype=np.int64)
    sample_last_segment[order] = rank[end_segment]
    paths = _paths(sample_last_segment, lengths, new_parent, seg_start, seg_len)
    return _gather_trained(samples, paths, lengths, torch.from_numpy(input_ids.astype(np.int64)),
                           position_ids, segment_ids, new_parent, seg_start, seg_len, subtree_end)


def _paths(last_segment: np.ndarray, lengths: np.ndarray, parent: np.ndarray, seg_start: np.ndarray,
           seg_len: np.ndarray) -> list[np.ndarray]:
    """Packed index of depths 0..L-1 of each sample, from its last segment up to the root."""
    paths = []
    for s, length in zip(last_segment.tolist(), lengths.tolist()):
        chain = []
        while s >= 0:
            chain.append(s)
            s = int(parent[s])
        ranges = [np.arange(seg_start[c], seg_start[c] + seg_len[c]) for c in reversed(chain)]
        path = np.concatenate(ranges)[:length]
        assert path.size == length, "sample path shorter than the sample"
        paths.append(path)
    return paths


def _gather_trained(samples, paths, lengths, input_ids, position_ids, segment_ids, parent, seg_start,
                    seg_len, subtree_end) -> PackedRow:
    pred, targets, adv, logp, owner = [], [], [], [], []
    topk_ids, topk_logp, cand_ids, cand_sizes = [], [], [], []
    has_topk = any(s.topk_ids is not None for s in samples)
    has_cand = any(s.candidate_ids is not None for s in samples)
    k_max = max((s.topk_ids.shape[1] for s in samples if s.topk_ids is not None), default=0)
    for i, (sample, path) in enumerate(zip(samples, paths)):
        t = np.flatnonzero(sample.trained_mask)
        pred.append(path[t - 1])
        targets.append(sample.token_ids[t])
        adv.append(np.full(t.size, sample.advantage, dtype=np.float32))
        logp.append(sample.sampler_logprobs[t])
        owner.append(np.full(t.size, i, dtype=np.int64))
        if has_topk:
            block_ids = np.full((t.size, k_max), -1, dtype=np.int32)
            block_logp = np.full((t.size, k_max), -np.inf, dtype=np.float32)
            if sample.topk_ids is not None:
                k = sample.topk_ids.shape[1]
                block_ids[:, :k] = sample.topk_ids[t]
                block_logp[:, :k] = sample.topk_logprobs[t]
            topk_ids.append(block_ids)
            topk_logp.append(block_logp)
        if has_cand:
            if sample.candidate_ids is None:
                cand_sizes.append(np.zeros(t.size, dtype=np.int64))
            else:
                off = sample.candidate_offsets
                starts, sizes = off[t], off[t + 1] - off[t]
                cand_sizes.append(sizes)
                cand_ids.append(sample.candidate_ids[concat_ranges(starts, sizes)])

    def cat(parts, dtype):
        return torch.from_numpy(np.concatenate(parts).astype(dtype, copy=False))

    candidate_ids = candidate_offsets = None
    if has_cand:
        sizes = np.concatenate(cand_sizes)
        offsets = np.zeros(sizes.size + 1, dtype=np.int64)
        np.cumsum(sizes, out=offsets[1:])
        candidate_offsets = torch.from_numpy(offsets)
        candidate_ids = cat(cand_ids, np.int64) if cand_ids else torch.zeros(0, dtype=torch.int64)
    return PackedRow(
        input_ids=input_ids,
        position_ids=torch.from_numpy(position_ids.astype(np.int64, copy=False)),
        segment_ids=torch.from_numpy(segment_ids.astype(np.int64, copy=False)),
        segment_parent=torch.from_numpy(parent.astype(np.int64, copy=False)),
        segment_start=torch.from_numpy(seg_start),
        segment_len=torch.from_numpy(seg_len),
        segment_subtree_end=torch.from_numpy(subtree_end),
        pred_index=cat(pred, np.int64),
        target_ids=cat(targets, np.int64),
        advantages=cat(adv, np.float32),
        sampler_logprobs=cat(logp, np.float32),
        sample_index=cat(owner, np.int64),
        completion_index=_completion_of_sample(samples)[cat(owner, np.int64)],
        topk_ids=cat(topk_ids, np.int64) if has_topk else None,
        topk_logprobs=cat(topk_logp, np.float32) if has_topk else None,
        candidate_ids=candidate_ids,
        candidate_offsets=candidate_offsets,
        sample_last_index=torch.from_numpy(np.array([p[-1] for p in paths], dtype=np.int64)),
        num_samples=len(samples),
        num_raw_tokens=int(lengths.sum()),
        group_ids=tuple(s.group_id for s in samples),
        model_versions=tuple(s.model_version for s in samples),
        rollout_ids=tuple(s.rollout_id for s in samples),
    )


def _completion_of_sample(samples) -> torch.Tensor:
    """Per sample, the index of its completion: samples of one rollout (same non-empty `rollout_id`,
    a multi-turn rollout that forked) share the first one's index; a sample without an id stands alone."""
    first: dict[str, int] = {}
    return torch.tensor([first.setdefault(s.rollout_id, i) if s.rollout_id else i for i, s in enumerate(samples)],
                        dtype=torch.int64)


def concat_ranges(starts: np.ndarray, sizes: np.ndarray) -> np.ndarray:
    """Concatenation of arange(start, start + size) for each pair, vectorised."""
    total = int(sizes.sum())
    if total == 0:
        return np.zeros(0, dtype=np.int64)
    ends = np.cumsum(sizes)
    return np.repeat(starts - (ends - sizes), sizes) + np.arange(total)


def sample_paths(row: PackedRow) -> list[np.ndarray]:
    """Packed index of each depth of each sample (root to last token), from the row alone."""
    parent = row.segment_parent.numpy()
    start = row.segment_start.numpy()
    length = row.segment_len.numpy()
    last = row.sample_last_index.numpy()
    last_segment = row.segment_ids.numpy()[last]
    lengths = row.position_ids.numpy()[last] + 1
    return _paths(last_segment, lengths, parent, start, length)


def unpack_token_ids(row: PackedRow) -> list[np.ndarray]:
    """Each sample's token ids read back from the row (a check that the layout is lossless)."""
    ids = row.input_ids.numpy()
    return [ids[path] for path in sample_paths(row)]
