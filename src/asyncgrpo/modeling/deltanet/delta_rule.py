"""The gated delta rule in chunks, pure PyTorch: over a forest of segments, or a padded batch.

The recurrence (per head; q and k l2-normalised, q scaled by K^-1/2; S is K x V):

    S_t = exp(g_t) S_{t-1} + k_t beta_t (v_t - exp(g_t) S_{t-1}^T k_t)^T,    o_t = S_t^T q_t

In chunks of C tokens (the algorithm of fla and transformers), with cum the cumulative log decay
inside a chunk, decay_ij = exp(cum_i - cum_j) for j <= i, and the chunk's start state S:

    A       = strictly_lower(beta_i k_i . k_j decay_ij)                     [C, C]
    [u | w] = (I + A)^-1 [beta v | beta k exp(cum)]                         (the WY form)
    delta   = u - w S                                                       [C, V]
    o       = (q exp(cum)) S + lower(q_i . k_j decay_ij) delta
    S'      = exp(cum_C) S + (k exp(cum_C - cum))^T delta

Everything but delta and S' is independent of the state, so it runs once for all chunks of a row
(`_intra_chunk`, `_chunk_outputs`); only the state pass walks chunk after chunk (`_state_pass`), on
the chunks that are at that point of their sequence, all of them at once. (I + A)^-1 is one
inverse by recursive doubling of the diagonal blocks (`unit_lower_inverse`, matmuls only, as fla's
blocked forward substitution), applied by one matmul, instead of triangular solves, whose batched
CUDA path and backward are slow.

`segment_tree_delta_rule` runs a packed row whose segments form a forest (`ChunkPlan`): each segment
is cut into chunks (only its last chunk padded, with zeros, which leave the state unchanged) and
starts from its parent's final state, so the state pass takes as many steps as the longest
root-to-leaf path has chunks, whatever the number of segments or levels. `chunk_gated_delta_rule`
runs a padded batch [B, L] with a batch of initial states.

Both callers share this code: tree packing (`packing/recurrent.py`: a packed row's trie, from
`packing/tree.py`) and the embedded server (`server/recurrent_state.py`: a step's prompt chunks as
root segments, its decode tokens as a batch of one-token chunks from the stored states).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

__all__ = [
    "CHUNK_SIZE",
    "ChunkPlan",
    "chunk_gated_delta_rule",
    "grouped_query_key",
    "l2_normalize",
    "normalized_query_key",
    "segment_tree_delta_rule",
    "unit_lower_inverse",
]

CHUNK_SIZE = 64  # the chunk length of transformers' and fla's chunked delta rule


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim (transformers' and fla's l2norm)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def grouped_query_key(query: torch.Tensor, key: torch.Tensor,
                      heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """query/key [..., Hk, K] repeated to the H value heads (each q/k head serves H / Hk consecutive ones)."""
    if key.shape[-2] != heads:
        query, key = (x.repeat_interleave(heads // x.shape[-2], dim=-2) for x in (query, key))
    return query, key


def normalized_query_key(query: torch.Tensor, key: torch.Tensor,
                         heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The raw query/key [..., Hk, K] as `chunk_gated_delta_rule` takes them: repeated to the H value
    heads, l2-normalised, query scaled by K^-1/2, in float32 (float64 stays float64)."""
    query, key = grouped_query_key(query, key, heads)
    dtype = torch.promote_types(query.dtype, torch.float32)
    return l2_normalize(query.to(dtype)) * query.shape[-1] ** -0.5, l2_normalize(key.to(dtype))


def unit_lower_inverse(a: torch.Tensor) -> torch.Tensor:
    """(I + strictly_lower(a))^-1 for a [..., C, C]: the diagonal and upper triangle of a are never read.

    Recursive doubling: with the inverses T11, T22 of two consecutive diagonal blocks of size b, the
    inverse of the 2b block they sit in is [[T11, 0], [-T22 L21 T11, T22]] (L21 the block of a below
    T11 and left of T22). log2(C) steps of batched matmuls, from blocks of one element; C is padded
    to a power of two (with an identity block, which leaves the top-left inverse unchanged).
    """
    size = a.shape[-1]
    padded = 1 << max(size - 1, 0).bit_length()
    if padded != size:
        a = F.pad(a, (0, padded - size, 0, padded - size))
    inverse = a.new_ones(*a.shape[:-2], padded, 1, 1)  # [..., n blocks, b, b]
    block = 1
    while block < padded:
        count = padded // (2 * block)
        # the diagonal blocks of size 2b of a, [..., count, 2b, 2b] (a view)
        diagonal = a.unflatten(-1, (count, 2 * block)).unflatten(-3, (count, 2 * block))
        diagonal = diagonal.diagonal(dim1=-4, dim2=-2).movedim(-1, -3)
        t11, t22 = inverse[..., 0::2, :, :], inverse[..., 1::2, :, :]
        t21 = -(t22 @ diagonal[..., block:, :block] @ t11)
        inverse = torch.cat([torch.cat([t11, torch.zeros_like(t11)], -1), torch.cat([t21, t22], -1)], -2)
        block *= 2
    return inverse[..., 0, :size, :size]


@dataclass(frozen=True, eq=False)
class ChunkPlan:
    """How the chunked delta rule walks a forest of segments (a packed row's trie, `tree.py`).

    Segment s has ceil(len / C) chunks and starts at step begin[s] = begin[parent] + chunks[parent]
    (0 for a root): its chunk j runs at step begin[s] + j, from the state its previous chunk (or its
    parent's last chunk) left. The chunk rows of the plan are in step order, and inside a step the
    segments that run longest come first, so the segments that finish at a step are its last rows
    and the state of the next step is mostly a prefix of this one's.

    chunk_tokens: [N, C] packed index of each chunk row's tokens (num_tokens, a zero row, past a
        segment's end).
    token_slot: [T] row * C + offset of each packed token.
    step_sizes: chunk rows of each step (consecutive).
    step_sources: per step, how its start states come from the previous step's end states: None
        (the same rows; always at step 0, which starts from the roots' initial states), an int n
        (the first n rows), or an index tensor [n] (a segment continues its own row or starts from
        its parent's).
    root_index: [R] which initial state (roots in segment order) each row of step 0 takes, or None
        when they are in segment order.
    finish_counts: per step, how many of its last rows finish their segment there.
    final_index: [S] position of each segment's final state in the concatenation of the finished
        rows of every step.
    """

    num_tokens: int
    chunk_size: int
    chunk_tokens: torch.Tensor
    token_slot: torch.Tensor
    step_sizes: tuple[int, ...]
    step_sources: tuple[torch.Tensor | int | None, ...]
    root_index: torch.Tensor | None
    finish_counts: tuple[int, ...]
    final_index: torch.Tensor
    _gather_index: dict = field(default_factory=dict, repr=False)

    @classmethod
    def build(cls, segment_parent, segment_start, segment_len, chunk_size: int = CHUNK_SIZE,
              device: torch.device | str | None = None) -> ChunkPlan:
        """From a row's segment arrays (numpy or tensors; each segment after its parent, as in the
        depth-first order of `tree.py`, and at least one token long)."""
        parent, start, length = (np.asarray(x.cpu() if isinstance(x, torch.Tensor) else x, dtype=np.int64)
                                 for x in (segment_parent, segment_start, segment_len))
        if length.size == 0 or length.min() < 1:
            raise ValueError("a chunk plan needs at least one segment and no empty segment")
        if np.any(parent >= np.arange(length.size)):
            raise ValueError("each segment must come after its parent (the depth-first order of "
                             "packing/tree.py)")
        num_segments, num_tokens = length.size, int(length.sum())
        chunks = -(-length // chunk_size)
        begin = np.zeros(num_segments, dtype=np.int64)
        for s in range(num_segments):
            if parent[s] >= 0:
                begin[s] = begin[parent[s]] + chunks[parent[s]]
        end = begin + chunks
        rows, sizes, sources, finish, finished = [], [], [], [], []
        position = np.full(num_segments, -1, dtype=np.int64)  # row of each segment in the previous step
        for step in range(int(end.max())):
            active = np.flatnonzero((begin <= step) & (step < end))
            active = active[np.lexsort((active, -end[active]))]  # longest running first
            if step:
                source = np.where(begin[active] < step, position[active], position[parent[active]])
                if source.size == sizes[-1] and np.array_equal(source, np.arange(source.size)):
                    sources.append(None)
                elif np.array_equal(source, np.arange(source.size)):
                    sources.append(int(source.size))
                else:
                    sources.append(_tensor(source, device))
            else:
                roots = np.flatnonzero(parent < 0)
                root_index = None if np.array_equal(active, roots) else np.searchsorted(roots, active)
            position[:] = -1
            position[active] = np.arange(active.size)
            count = int((end[active] == step + 1).sum())
            finished.append(active[active.size - count:])
            rows.append((active, step - begin[active]))
            sizes.append(int(active.size))
            finish.append(count)
        segment = np.concatenate([r[0] for r in rows])
        offset = np.concatenate([r[1] for r in rows])[:, None] * chunk_size + np.arange(chunk_size)
        tokens = np.where(offset < length[segment, None], start[segment, None] + offset, num_tokens)
        slot = np.empty(num_tokens, dtype=np.int64)
        valid = tokens < num_tokens
        slot[tokens[valid]] = np.flatnonzero(valid)
        final_index = np.empty(num_segments, dtype=np.int64)
        final_index[np.concatenate(finished)] = np.arange(num_segments)
        return cls(num_tokens=num_tokens, chunk_size=chunk_size, chunk_tokens=_tensor(tokens, device),
                   token_slot=_tensor(slot, device), step_sizes=tuple(sizes),
                   step_sources=tuple([None] + sources),
                   root_index=None if root_index is None else _tensor(root_index, device),
                   finish_counts=tuple(finish), final_index=_tensor(final_index, device))

    @property
    def num_chunks(self) -> int:
        return sum(self.step_sizes)

    def gather_index(self, source_heads: int, heads: int) -> torch.Tensor:
        """[N, H, C] index into a [T + 1, source_heads] flattening of each chunk row's tokens per head
        (source head h * source_heads // heads serves head h: grouped query/key heads)."""
        key = (source_heads, heads)
        if key not in self._gather_index:
            head = torch.arange(heads, device=self.chunk_tokens.device) // (heads // source_heads)
            self._gather_index[key] = self.chunk_tokens[:, None, :] * source_heads + head[None, :, None]
        return self._gather_index[key]

    def scatter_index(self, heads: int) -> torch.Tensor:
        """[T, H] index of each token's output in an [N, H, C] flattening of the chunk rows."""
        if ("out", heads) not in self._gather_index:
            size = self.chunk_size
            row, offset = self.token_slot // size, self.token_slot % size
            head = torch.arange(heads, device=row.device)
            index = (row[:, None] * heads + head[None, :]) * size + offset[:, None]
            self._gather_index[("out", heads)] = index
        return self._gather_index[("out", heads)]


def _tensor(array: np.ndarray, device) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(array, dtype=np.int64)).to(device)


def _to_chunks(x: torch.Tensor, plan: ChunkPlan, heads: int, dtype: torch.dtype) -> torch.Tensor:
    """x [T, Hx, ...] (Hx dividing H) as chunk rows [N, H, C, ...] in `dtype`, zeros past segment ends."""
    index = plan.gather_index(x.shape[1], heads)
    x = torch.cat([x, x.new_zeros(1, *x.shape[1:])])
    rows = x.reshape(-1, *x.shape[2:]).index_select(0, index.flatten())
    return rows.view(*index.shape, *x.shape[2:]).to(dtype)  # gathered first: bf16 inputs move half the bytes


def segment_tree_delta_rule(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, g: torch.Tensor,
                            beta: torch.Tensor, plan: ChunkPlan, initial_state: torch.Tensor | None = None,
                            output_final_state: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The gated delta rule over a packed row whose segments form a forest (`ChunkPlan`): each root
    starts from its initial state (zeros if None), every other segment from its parent's final state.

    query/key [T, Hk, K] (l2-normalised, query scaled; Hk dividing H: grouped heads), value [T, H, V],
    g (log decay, <= 0) and beta [T, H], initial_state [R, H, K, V] for the R roots in segment order.
    Returns the output [T, H, V] and, if asked, each segment's final state [S, H, K, V], both in
    float32 (float64 for float64 inputs).
    """
    dtype = torch.promote_types(query.dtype, torch.float32)
    heads, dim_v = value.shape[1:]
    q, k = (_to_chunks(x, plan, heads, dtype) for x in (query, key))
    v = _to_chunks(value, plan, heads, dtype)
    g, beta = (_to_chunks(x, plan, heads, dtype) for x in (g, beta))
    u, w_neg, q_decayed, intra, k_decayed_t, chunk_decay = _intra_chunk(q, k, v, g, beta)
    if initial_state is None:
        initial = q.new_zeros(plan.step_sizes[0], heads, key.shape[-1], dim_v)
    else:
        initial = initial_state.to(dtype)
        initial = initial if plan.root_index is None else initial.index_select(0, plan.root_index)
    states, deltas, finished = _state_pass(u, w_neg, k_decayed_t, chunk_decay, initial, plan.step_sizes,
                                           plan.step_sources,
                                           plan.finish_counts if output_final_state else None)
    out = _chunk_outputs(q_decayed, intra, states, deltas)  # [N, H, C, V]
    out = out.reshape(-1, dim_v).index_select(0, plan.scatter_index(heads).flatten()).view(-1, heads, dim_v)
    final = finished.index_select(0, plan.final_index) if output_final_state else None
    return out, final


def chunk_gated_delta_rule(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, g: torch.Tensor,
                           beta: torch.Tensor, initial_state: torch.Tensor | None = None,
                           chunk_size: int = CHUNK_SIZE) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule in chunks, on a batch of sequences.

    query/key [B, L, H, K] (already l2-normalised; query already scaled), value [B, L, H, V], g (log
    decay, <= 0) and beta [B, L, H], initial_state [B, H, K, V] or None (zeros). Returns the output
    [B, L, H, V] and the final state [B, H, K, V], both in float32 (float64 for float64 inputs).
    Positions padded with k = v = beta = g = 0 leave the state unchanged, so a batch of sequences
    padded at the end has exact final states.
    """
    dtype = torch.promote_types(query.dtype, torch.float32)
    batch, length, heads, dim_k = key.shape
    dim_v = value.shape[-1]
    pad = (-length) % chunk_size
    num_chunks = (length + pad) // chunk_size

    def chunked(x: torch.Tensor) -> torch.Tensor:  # [B, L, H, ...] -> [chunks * B, H, C, ...], step major
        x = F.pad(x.to(dtype), (0, 0) * (x.dim() - 2) + (0, pad)).unflatten(1, (num_chunks, chunk_size))
        return x.movedim(1, 0).transpose(2, 3).reshape(num_chunks * batch, heads, chunk_size, *x.shape[4:])

    chunks = [chunked(x) for x in (query, key, value, g, beta)]
    u, w_neg, q_decayed, intra, k_decayed_t, chunk_decay = _intra_chunk(*chunks)
    initial = (query.new_zeros(batch, heads, dim_k, dim_v, dtype=dtype) if initial_state is None
               else initial_state.to(dtype))
    steps = (batch,) * num_chunks
    states, deltas, final = _state_pass(u, w_neg, k_decayed_t, chunk_decay, initial, steps,
                                        (None,) * num_chunks, (0,) * (num_chunks - 1) + (batch,))
    out = _chunk_outputs(q_decayed, intra, states, deltas).view(num_chunks, batch, heads, chunk_size, dim_v)
    out = out.permute(1, 0, 3, 2, 4).reshape(batch, num_chunks * chunk_size, heads, dim_v)[:, :length]
    return out, final


def _intra_chunk(q, k, v, g, beta):
    """The state-independent part of every chunk. q/k [N, H, C, K], v [N, H, C, V], g/beta [N, H, C].
    Returns u [N, H, C, V], -w [N, H, C, K], q exp(cum) [N, H, C, K], the masked intra-chunk scores
    [N, H, C, C], (k exp(cum_C - cum))^T [N, H, K, C] and the chunk's decay exp(cum_C) [N, H]."""
    size = q.shape[-2]
    cum = g.cumsum(-1)  # log of the decay from the chunk start to each position
    above = torch.ones(size, size, dtype=torch.bool, device=q.device).triu(1)
    pair_decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(above, float("-inf")).exp()
    # only the strictly lower triangle of the system is read: no mask for its diagonal
    system = (k @ k.transpose(-1, -2)) * pair_decay * beta[..., :, None]
    solve = unit_lower_inverse(system) * beta[..., None, :]  # (I + A)^-1 diag(beta)
    cum_exp = cum.exp()
    u = solve @ v
    w_neg = solve @ (k * -cum_exp[..., None])  # -w: delta = u + (-w) S needs no scaling, nor its backward
    intra = (q @ k.transpose(-1, -2)) * pair_decay
    k_decayed_t = (k * (cum[..., -1:] - cum).exp()[..., None]).transpose(-1, -2)
    return u, w_neg, q * cum_exp[..., None], intra, k_decayed_t, cum_exp[..., -1].contiguous()


def _state_pass(u, w_neg, k_decayed_t, chunk_decay, initial, step_sizes, step_sources, finish_counts):
    """The sequential part: chunk rows of step t are the `step_sizes[t]` rows after those of earlier
    steps; each step's start states come from the previous step's end states (`ChunkPlan.step_sources`).
    Returns the start state of every row [N, H, K, V], every row's delta [N, H, C, V] and (when
    `finish_counts` is given) the end states of the rows finishing at each step, concatenated."""
    heads, dim_k, dim_v = initial.shape[1:]
    split = [torch.split(x, list(step_sizes)) for x in (u, w_neg, k_decayed_t, chunk_decay)]
    state, states, deltas, finished = initial, [], [], []
    for step, (u_t, w_t, kt_t, decay_t) in enumerate(zip(*split)):
        source = step_sources[step]
        if isinstance(source, int):
            state = state[:source]
        elif source is not None:
            state = state.index_select(0, source)
        rows = u_t.shape[0]
        flat = state.reshape(rows * heads, dim_k, dim_v)
        delta = torch.baddbmm(u_t.flatten(0, 1), w_t.flatten(0, 1), flat)  # u - w S
        states.append(state)
        deltas.append(delta)
        state = torch.baddbmm(flat * decay_t.reshape(-1, 1, 1), kt_t.flatten(0, 1), delta)
        state = state.view(rows, heads, dim_k, dim_v)
        if finish_counts is not None and finish_counts[step]:
            finished.append(state[rows - finish_counts[step]:])
    final = None if finish_counts is None else torch.cat(finished) if len(finished) > 1 else finished[0]
    return torch.cat(states), torch.cat(deltas), final


def _chunk_outputs(q_decayed, intra, states, deltas):
    """o = (q exp(cum)) S + intra delta per chunk row: [N, H, C, V]."""
    rows, heads, size, _ = q_decayed.shape
    dim_v = states.shape[-1]
    out = torch.baddbmm(intra.flatten(0, 1) @ deltas, q_decayed.flatten(0, 1), states.flatten(0, 1))
    return out.view(rows, heads, size, dim_v)
