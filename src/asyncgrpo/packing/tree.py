"""Tree packing: training samples -> one row, a prefix trie laid out depth first.

This module owns the layout of one packed row (`PackedRow`) of `asyncgrpo.types.Sample`s, the
record that crosses from the rollout process to the trainer. Everything here is pure (numpy in,
torch tensors out).

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
from dataclasses import dataclass, field

import numpy as np
import torch

from asyncgrpo.types import Sample  # re-exported: asyncgrpo.packing.Sample is public

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
    sampler_topk_ids: torch.Tensor | None  # [N, K] int64, pad -1
    sampler_topk_logprobs: torch.Tensor | None  # [N, K] float32, pad -inf
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
            moved[name] = (value.to(device, non_blocking=non_blocking) if isinstance(value, torch.Tensor)
                           else value)
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
    has_topk = any(s.sampler_topk_ids is not None for s in samples)
    has_cand = any(s.candidate_ids is not None for s in samples)
    k_max = max((s.sampler_topk_ids.shape[1] for s in samples if s.sampler_topk_ids is not None), default=0)
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
            if sample.sampler_topk_ids is not None:
                k = sample.sampler_topk_ids.shape[1]
                block_ids[:, :k] = sample.sampler_topk_ids[t]
                block_logp[:, :k] = sample.sampler_topk_logprobs[t]
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
        sampler_topk_ids=cat(topk_ids, np.int64) if has_topk else None,
        sampler_topk_logprobs=cat(topk_logp, np.float32) if has_topk else None,
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
    return torch.tensor([first.setdefault(s.rollout_id, i) if s.rollout_id else i
                         for i, s in enumerate(samples)], dtype=torch.int64)


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
