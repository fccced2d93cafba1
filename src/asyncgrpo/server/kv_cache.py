"""Paged KV cache and the attention function that reads and writes it.

Layout: per layer, K and V pools of shape [num_blocks, block_size, kv_heads, head_dim]. A sequence
owns a list of blocks (its block table); token `p` of a sequence lives in block `table[p // bs]`,
row `p % bs`. `prefix_cache.BlockPool` hands out and takes back whole blocks (shared between
sequences when they hold the same prefix).

One forward pass serves every scheduled sequence: the runner flattens the step into a single row
of T tokens (decode tokens first, one per running sequence, then the prompts being prefilled),
passes explicit `position_ids`, and hands the per-step `AttentionMetadata` to the model through the
forward kwargs (`kv_meta=`), which transformers forwards to the registered attention function:

    decode part   each sequence's query attends over its cached keys (`decode_attention.py`)
    prefill part  q of each prompt from token 0 attends causally over its own fresh keys; chunks that
                  continue after cached tokens (a cached prefix, earlier chunks) attend over their
                  whole context in the cache, the short ones as rows of the decode attention
                  (`context_attention.py`). Where FlashAttention's variable-length kernel runs, both
                  stay packed (`varlen_attention.py`); elsewhere they are padded into a batch

The model's layers compute q/k/v, norms and RoPE (their own forwards, or the fused ones of
`fused_layers.py`, whose rotary kernel also writes the cache rows); nothing here is model-specific
beyond the attention module exposing `layer_idx`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from transformers import AttentionInterface

from asyncgrpo.server.attention_math import attend, in_window
from asyncgrpo.server.context_attention import (
    ContinuedPrefill,
    ContinuedRows,
    continued_attention,
    continued_layout,
    continued_rows,
    num_row_chunks,
    pad_indices,
    rows_attention,
)
from asyncgrpo.server.decode_attention import decode_attention
from asyncgrpo.server.host_copy import to_device
from asyncgrpo.server.shared_prefix import SharedPrefixes, SharedPrefixTensors
from asyncgrpo.server.varlen_attention import (
    VarlenChunks,
    continued_varlen_attention,
    fresh_attention,
    varlen_chunks,
)

ATTENTION_NAME = "asyncgrpo_paged"


class PagedKVCache:
    """The K/V pools of every layer (preallocated once). Block `num_blocks` is an extra scratch block
    that no sequence owns: padded rows of a fixed-shape (graph) step write and read there, and the
    block-table entries of blocks released behind a sliding window point there (masked out)."""

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        attention_layers: Sequence[int] | None = None,
    ) -> None:
        shape = (num_blocks + 1, block_size, num_kv_heads, head_dim)
        # a hybrid's recurrent layers (attention_layers leaves them out) keep no keys/values: empty pools
        keep = set(range(num_layers) if attention_layers is None else attention_layers)
        self.k = [torch.zeros(shape if i in keep else 0, dtype=dtype, device=device) for i in range(num_layers)]
        self.v = [torch.zeros(shape if i in keep else 0, dtype=dtype, device=device) for i in range(num_layers)]
        self.num_blocks = num_blocks
        self.scratch_block = num_blocks
        self.block_size = block_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * num_kv_heads * head_dim * torch.empty(0, dtype=dtype).element_size()


@dataclass
class AttentionMetadata:
    """What the attention function needs for one step (device tensors unless noted)."""

    cache: PagedKVCache
    slot_mapping: torch.Tensor  # [T] int64: flat cache row of every token of the step
    num_decode: int  # host: the first num_decode tokens are decode tokens, one per sequence
    block_tables: torch.Tensor | None  # [Bd, nb] int64 blocks of the decode sequences (0-padded)
    context_lens: torch.Tensor | None  # [Bd] int64: cached tokens incl. the new one
    prefill_lens: list[int]  # host: new tokens of each prompt prefilled from token 0, in order
    pad_index: torch.Tensor | None  # [Bp * Lmax] int64 into the prefill tokens (0 where padding)
    unpad_index: torch.Tensor | None  # [Tp] int64 into the padded [Bp * Lmax] layout
    # chunks that continue after cached tokens, after the prompts from token 0: the short ones first
    # as rows of the decode attention, then the others packed or padded (None: there are none)
    continued_rows: ContinuedRows | None = None
    continued: VarlenChunks | ContinuedPrefill | None = None
    # decode sequences whose first blocks are the same, read once per group (shared_prefix.py)
    shared: SharedPrefixTensors | None = None
    fresh: VarlenChunks | None = None  # the prompts from token 0, packed (else pad_index/unpad_index)


def build_metadata(
    cache: PagedKVCache,
    slot_mapping: Sequence[int],
    decode_tables: torch.Tensor | None,
    decode_lens: Sequence[int],
    prefill_lens: list[int],
    device: torch.device,
    prefill_starts: Sequence[int] | None = None,
    prefill_tables: Sequence[Sequence[int]] | np.ndarray | None = None,
    decode_shared: SharedPrefixes | None = None,
    row_members: int = 0,
    varlen: bool = False,
) -> AttentionMetadata:
    """Host data (lists or int64 arrays) -> AttentionMetadata. decode_tables: CPU int64 [Bd, nb]
    (entries past a sequence's blocks are ignored through decode_lens). prefill_starts: position of
    each prefilled sequence's first new token (tokens before it are in the cache; those starting at
    0 come first), with prefill_tables their blocks; None: every prompt starts at 0. decode_shared:
    the decode sequences' shared first blocks (`shared_prefix.find_shared_prefixes`), if any.
    row_members: >= 2 lays the leading short continued chunks out as rows of the decode attention
    (`context_attention.continued_rows`), in runs of up to that many rows of one sequence that read its
    cached blocks once; the rest (all of them with < 2) are padded (`continued_layout`). varlen: prompts
    from token 0 and the continued chunks that are not rows stay packed for FlashAttention
    (`varlen_attention.py`) instead of padded."""
    block_tables = context_lens = pad_index = unpad_index = continued = rows = fresh = None
    if len(decode_lens):
        block_tables = to_device(decode_tables, device)
        context_lens = to_device(np.asarray(decode_lens, dtype=np.int64), device)
    prefill_lens = list(prefill_lens)
    num_fresh = len(prefill_lens)
    if prefill_starts is not None:
        num_fresh = sum(1 for s in prefill_starts if s == 0)
        assert not any(prefill_starts[:num_fresh]), "prompts from token 0 must come first"
    if num_fresh < len(prefill_lens):
        lens, starts, tables = prefill_lens[num_fresh:], prefill_starts[num_fresh:], prefill_tables[num_fresh:]
        n = num_row_chunks(lens, row_members)
        if n:
            rows = continued_rows(cache.block_size, cache.scratch_block, lens[:n], starts[:n], tables[:n], device,
                                  row_members)
        if n < len(lens) and varlen:
            continued = varlen_chunks(lens[n:], starts[n:], tables[n:], cache.block_size, device)
        elif n < len(lens):
            continued = continued_layout(cache.block_size, cache.scratch_block * cache.block_size, lens[n:],
                                         starts[n:], tables[n:], device)
        prefill_lens = prefill_lens[:num_fresh]
    if prefill_lens and varlen:
        fresh = varlen_chunks(prefill_lens, [0] * len(prefill_lens), None, cache.block_size, device)
    elif len(prefill_lens) > 1:
        pad, unpad = pad_indices(prefill_lens)
        pad_index = to_device(pad, device)
        unpad_index = to_device(unpad, device)
    return AttentionMetadata(
        cache=cache,
        slot_mapping=to_device(np.asarray(slot_mapping, dtype=np.int64), device),
        num_decode=len(decode_lens),
        block_tables=block_tables,
        context_lens=context_lens,
        prefill_lens=prefill_lens,
        pad_index=pad_index,
        unpad_index=unpad_index,
        continued_rows=rows,
        continued=continued,
        shared=None if decode_shared is None else decode_shared.to(device),
        fresh=fresh,
    )


def _prefill_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    meta: AttentionMetadata,
    scaling: float,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """q [H, Tp, D], k/v [KVH, Tp, D] of prompts from token 0 -> [Tp, H, D] (causal within each
    prompt, and within the layer's sliding window)."""
    h, _, d = q.shape
    gqa = h != k.shape[0]
    plain = window is None and not softcap
    if len(meta.prefill_lens) == 1:
        if plain:
            out = F.scaled_dot_product_attention(q[None], k[None], v[None], is_causal=True, scale=scaling, enable_gqa=gqa)
        else:
            out = attend(q[None], k[None], v[None], _causal(q.shape[1], window, q.device), scaling, softcap)
        return out[0].transpose(0, 1)
    bp, lmax = len(meta.prefill_lens), max(meta.prefill_lens)

    def pad(x: torch.Tensor) -> torch.Tensor:
        return x.index_select(1, meta.pad_index).view(x.shape[0], bp, lmax, d).transpose(0, 1)

    # padding sits after each prompt, so the causal mask alone keeps real queries off it
    if plain:
        out = F.scaled_dot_product_attention(pad(q), pad(k), pad(v), is_causal=True, scale=scaling, enable_gqa=gqa)
    else:
        out = attend(pad(q), pad(k), pad(v), _causal(lmax, window, q.device), scaling, softcap)
    return out.transpose(1, 2).reshape(bp * lmax, h, d).index_select(0, meta.unpad_index)


def _causal(n: int, window: int | None, device: torch.device) -> torch.Tensor:
    """[n, n] bool: query i sees keys j <= i inside its window."""
    pos = torch.arange(n, device=device)
    return (pos[None, :] <= pos[:, None]) & in_window(pos[:, None], pos[None, :], window)


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers attention interface: query [1, H, T, D], key/value [1, KVH, T, D] for the flat
    step; returns ([1, T, H, D], None). Writes this step's keys/values into the paged cache, unless
    the caller did (`kv_written=True`: the fused attention forward writes them in its rotary kernel)."""
    meta: AttentionMetadata | None = kwargs.get("kv_meta")
    if meta is None:
        raise RuntimeError(
            f"attention implementation {ATTENTION_NAME!r} needs the step metadata (kv_meta=...); "
            "it only runs inside the embedded server's model runner"
        )
    layer = module.layer_idx
    cache = meta.cache
    q, k, v = query[0], key[0], value[0]
    flat = (-1, cache.num_kv_heads, cache.head_dim)
    if not kwargs.get("kv_written"):
        cache.k[layer].view(flat).index_copy_(0, meta.slot_mapping, k.transpose(0, 1))
        cache.v[layer].view(flat).index_copy_(0, meta.slot_mapping, v.transpose(0, 1))
    nd = meta.num_decode
    scale = scaling if scaling is not None else q.shape[-1] ** -0.5
    # per layer, from the model's attention module (Mistral, Qwen2, Gemma 2/3, Cohere2, ...)
    window, softcap = kwargs.get("sliding_window"), kwargs.get("softcap")
    parts = []
    if nd:
        parts.append(decode_attention(
            q[:, :nd].transpose(0, 1), cache.k[layer], cache.v[layer], meta.block_tables, meta.context_lens, scale,
            window, softcap, meta.shared,
        ))
    nf = nd + sum(meta.prefill_lens)
    # (the runner packs prompt chunks only for models without soft-capped layers: `varlen_attention.py`)
    assert not softcap or (meta.fresh is None and not isinstance(meta.continued, VarlenChunks))
    if meta.fresh is not None:
        parts.append(fresh_attention(q[:, nd:nf], k[:, nd:nf], v[:, nd:nf], meta.fresh, scale, window))
    elif meta.prefill_lens:
        parts.append(_prefill_attention(q[:, nd:nf], k[:, nd:nf], v[:, nd:nf], meta, scale, window, softcap))
    if meta.continued_rows is not None:
        nr = nf + meta.continued_rows.num_tokens
        parts.append(rows_attention(q[:, nf:nr], cache.k[layer], cache.v[layer], meta.continued_rows, scale, window,
                                    softcap))
        nf = nr
    if isinstance(meta.continued, VarlenChunks):
        parts.append(continued_varlen_attention(q[:, nf:], cache.k[layer], cache.v[layer], meta.continued, scale,
                                                window))
    elif meta.continued is not None:
        parts.append(
            continued_attention(q[:, nf:], cache.k[layer], cache.v[layer], meta.continued, scale, window, softcap)
        )
    out = parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)
    return out[None], None


def register_attention() -> str:
    """Register the paged attention with transformers (idempotent) and return its name."""
    AttentionInterface.register(ATTENTION_NAME, paged_attention_forward)
    return ATTENTION_NAME
