"""Segment kind `decode_shared`: decode rows whose first KV blocks are the same, read once for all.

With prefix caching, the samples of a GRPO group (the same prompt sent G times) hold the same
physical blocks for the whole prompt. Decode attention that walks each sequence's blocks on its own
reads that prompt G times per layer and step; at 2048-token prompts and 256-token completions that
is ~90 % of the KV it reads. Instead each such sequence's context is split in two:

    shared part   tokens [0, shared_len) of the group, read once by one program per (group, kv
                  head, split) for the queries of all its members (members x query heads per kv head
                  rows of one tile), giving each member a partial softmax (sum, max, normaliser)
    own part      tokens [shared_len, context) of the sequence, as before

and the partial results are merged exactly (the flash-decoding merge of splits).

The groups are found on the host, once per step, from the decode block tables (`find_shared_prefixes`):
sequences whose tables start with the same blocks share those blocks' KV (a block id names one copy of
the KV; only full, cached blocks are ever shared). Pure numpy. Two backends compute the segment:
`TritonSharedDecode` (the Triton kernels' shared pass, where its check passes) and
`GatherSharedDecode` (the same arithmetic in plain torch, any device, layers without window or
soft-cap). Windowed layers read each sequence's own blocks (members at different lengths see
different windows): for them, and where neither serves, the plan takes a `decode` backend, which reads
the same segment and ignores its groups.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch

from asyncgrpo.server.attention.base import (
    SHARED,
    AttentionBackend,
    DecodeSegment,
    Probe,
    SharedPrefixTensors,
    Support,
    Variant,
)
from asyncgrpo.server.attention.decode import (
    first_pools,
    triton_matches_gather,
    triton_serves,
    triton_works_on,
    warm_up_options,
    warm_up_rows,
)
from asyncgrpo.server.decode_kernels import decode_attention_triton
from asyncgrpo.server.host_copy import to_device

# a group's part is worth a separate pass from this many shared blocks on
MIN_SHARED_BLOCKS = 4
# query rows one program of the shared pass holds in its tile (members x query heads per kv head)
MAX_ROWS = 32


def max_members(num_heads: int, num_kv_heads: int) -> int:
    """Members one group entry holds: as many as MAX_ROWS query rows allow (0: sharing is not worth it,
    a program would hold one member only)."""
    per_kv = num_heads // num_kv_heads
    members = MAX_ROWS // per_kv
    return members if members >= 2 else 0


@dataclass
class SharedPrefixes:
    """The shared parts of one decode step (host int64 arrays).

    lens    [B]: tokens [0, lens[i]) of decode sequence i are read by its group's pass (0: none)
    groups  [G, 1 + M]: per group entry, its shared tokens, then the batch indices of its members
            (at most M, padded with -1); the first member's block table gives the blocks
    """

    lens: np.ndarray
    groups: np.ndarray

    @property
    def num_groups(self) -> int:
        return self.groups.shape[0]

    def to(self, device: torch.device) -> SharedPrefixTensors:
        return SharedPrefixTensors(to_device(self.lens, device),
                                   to_device(self.groups, device))

    @staticmethod
    def concat(first: SharedPrefixes | None, num_first: int, second: SharedPrefixes | None,
               num_second: int) -> SharedPrefixes | None:
        """The groups of a batch of `num_first` rows followed by `num_second` rows, from each part's own
        (None: no groups there); entries keep their width (members per entry)."""
        if first is None and second is None:
            return None
        parts = [(first, num_first, 0), (second, num_second, num_first)]
        lens = np.concatenate([np.zeros(n, np.int64) if p is None else p.lens for p, n, _ in parts])
        groups = []
        for p, _, offset in parts:
            if p is not None:
                g = p.groups.copy()
                g[:, 1:] = np.where(g[:, 1:] >= 0, g[:, 1:] + offset, -1)
                groups.append(g)
        return SharedPrefixes(lens, np.concatenate(groups))


def find_shared_prefixes(
    tables: np.ndarray,
    context_lens: np.ndarray,
    block_size: int,
    members: int,
    null_block: int,
    min_blocks: int = MIN_SHARED_BLOCKS,
) -> SharedPrefixes | None:
    """Groups of decode sequences whose block tables ([B, nb], context_lens [B] incl. the new token)
    start with the same blocks, at most `members` per entry; None when no two share `min_blocks`.

    Only blocks wholly before a sequence's new token count (they are full, and the sequence's own
    part is never empty); `null_block` (released entries) never does. The tables are sorted so that
    sequences with a common prefix are neighbours; an entry grows along that order while the next
    sequence shares at least half of what the entry shares so far (a group's 2048-token prompt is
    not cut down to the short system prompt that every group starts with)."""
    b = len(context_lens)
    if members < 2 or b < 2:
        return None
    full = (np.asarray(context_lens, dtype=np.int64) - 1) // block_size  # blocks wholly before the new token
    width = int(full.max())
    if width < min_blocks:
        return None
    limit = full  # blocks each sequence may share: up to its new token's block, and its first null entry
    null = tables[:, :width] == null_block
    if null.any():
        limit = np.minimum(full, np.where(null.any(axis=1), null.argmax(axis=1), width))
    rows = np.where(np.arange(width)[None, :] < limit[:, None], tables[:, :width], -1)
    # any lexicographic order keeps the sequences of a common prefix together (bytes compare fastest)
    order = np.array(sorted(range(b), key=lambda i: rows[i].tobytes()), dtype=np.int64)
    same = rows[order[1:]] == rows[order[:-1]]
    first_diff = np.where(same.all(axis=1), width, same.argmin(axis=1))
    # blocks shared by each sorted neighbour pair
    common = np.minimum(first_diff, np.minimum(limit[order[1:]], limit[order[:-1]])).tolist()
    lens = np.zeros(b, dtype=np.int64)
    entries: list[list[int]] = []
    chunk, shared = [int(order[0])], width  # blocks the entry shares (meaningless for one member)

    def close() -> None:
        if len(chunk) >= 2:
            lens[chunk] = shared * block_size
            entries.append([shared * block_size, *chunk, *([-1] * (members - len(chunk)))])

    for i, c in enumerate(common):
        nxt = int(order[i + 1])
        if len(chunk) < members and c >= min_blocks and (len(chunk) == 1 or 2 * c >= shared):
            shared = c if len(chunk) == 1 else min(shared, c)
            chunk.append(nxt)
        else:
            close()
            chunk = [nxt]
    close()
    if not entries:
        return None
    return SharedPrefixes(lens=lens, groups=np.asarray(entries, dtype=np.int64))


def member_leaders(shared: SharedPrefixTensors, batch: int) -> torch.Tensor:
    """[B] int64: the batch index whose block table gives each sequence's shared blocks (the first member
    of its group entry; itself when it is in none)."""
    leaders = torch.arange(batch, device=shared.lens.device)
    members = shared.groups[:, 1:]
    ok = members >= 0
    first = members[:, :1].expand_as(members)
    return leaders.index_put((members[ok],), first[ok])


def decode_attention_shared_gather(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    shared: SharedPrefixTensors,
) -> torch.Tensor:
    """What the Triton kernels compute, in plain torch: each sequence's shared tokens [0, lens) read
    through its group's first member's table, its own tokens [lens, context) through its own, the two
    partial softmaxes merged. Shapes as `decode.decode_attention_gather` (no window, no soft-cap).
    Equals plain attention exactly when the groups only claim blocks their members share."""
    bd, h, d = q.shape
    _, block_size, kvh, _ = k_pool.shape
    length = block_tables.shape[1] * block_size
    pos = torch.arange(length, device=q.device)[None, :]
    query = q.float().reshape(bd, kvh, h // kvh, d)

    def partial(tables: torch.Tensor, visible: torch.Tensor):
        keys = k_pool.index_select(0, tables.reshape(-1)).view(bd, length, kvh, d).float()
        values = v_pool.index_select(0, tables.reshape(-1)).view(bd, length, kvh, d).float()
        scores = torch.einsum("bkgd,blkd->bkgl", query, keys) * scale
        scores = scores.masked_fill(~visible[:, None, None, :], float("-inf"))
        m = scores.amax(-1, keepdim=True)
        p = torch.exp(scores - m.clamp_min(torch.finfo(torch.float32).min))  # an empty part: m = -inf, p = 0
        return torch.einsum("bkgl,blkd->bkgd", p, values), p.sum(-1, keepdim=True), m

    lens = shared.lens[:, None]
    own = partial(block_tables, (pos >= lens) & (pos < context_lens[:, None]))
    common = partial(block_tables[member_leaders(shared, bd)], pos < lens)
    m = torch.maximum(own[2], common[2])  # own[2] is finite: the new token is always its own
    w_own, w_common = torch.exp(own[2] - m), torch.exp(common[2] - m)
    out = (own[0] * w_own + common[0] * w_common) / (own[1] * w_own + common[1] * w_common)
    return out.reshape(bd, h, d).to(q.dtype)


@functools.cache
def shared_pass_works_on(device: torch.device, dtype: torch.dtype, capped: bool = False) -> bool:
    """The Triton check (`decode.triton_works_on`) for the shared-prefix pass (layers without a window);
    where it fails, decode attention keeps the plain Triton kernel and reads every sequence's blocks
    itself."""
    return triton_works_on(device, dtype, False, capped) and triton_matches_gather(
        device, dtype, shared_pass=True, windowed=False, capped=capped)


class TritonSharedDecode(AttentionBackend):
    """The Triton kernels with their shared pass: each group entry's blocks once, then each row's own."""

    kind = SHARED
    name = "triton_shared"
    support = Support(devices=frozenset({"cuda"}), windows=False, graphs=True)
    reads = DecodeSegment

    @classmethod
    def check(cls, probe: Probe, variant: Variant) -> bool:
        return triton_serves(probe.device, probe.dtype, probe.head_dim, *variant) and shared_pass_works_on(
            probe.device, probe.dtype, variant[1])

    def forward(self, q, k, v, k_pool, v_pool, segment: DecodeSegment, scale, window,
                softcap) -> torch.Tensor:
        return decode_attention_triton(q.transpose(0, 1), k_pool, v_pool, segment.block_tables,
                                       segment.context_lens, scale, shared=segment.shared, window=window,
                                       softcap=softcap)

    def warm_up(self, cache, variant: Variant) -> None:
        """The shared pass with groups of the plan's members (its split counts are run-time arguments)."""
        q, tables, lens = warm_up_rows(cache, self.probe.num_heads)
        device, block_size = q.device, cache.block_size
        groups = torch.full((1, 1 + self.probe.shared_members), -1, dtype=torch.int64, device=device)
        groups[0, :3] = torch.tensor([block_size, 0, 1])
        shared = SharedPrefixTensors(torch.full((2,), block_size, dtype=torch.int64, device=device), groups)
        decode_attention_triton(q, *first_pools(cache), tables, lens, 1.0, num_splits=1, shared=shared,
                                num_shared_splits=2, **warm_up_options(block_size, variant))


class GatherSharedDecode(AttentionBackend):
    """`decode_attention_shared_gather`: what the kernels compute, in plain torch (any device; no window,
    no soft-cap)."""

    kind = SHARED
    name = "gather_shared"
    support = Support(windows=False, softcap=False, graphs=True)
    reads = DecodeSegment

    def forward(self, q, k, v, k_pool, v_pool, segment: DecodeSegment, scale, window,
                softcap) -> torch.Tensor:
        return decode_attention_shared_gather(q.transpose(0, 1), k_pool, v_pool, segment.block_tables,
                                              segment.context_lens, scale, segment.shared)
