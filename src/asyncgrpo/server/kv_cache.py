"""Paged KV cache and the attention function that reads and writes it.

Layout: per layer, K and V pools of shape [num_blocks, block_size, kv_heads, head_dim]. A sequence
owns a list of blocks (its block table); token `p` of a sequence lives in block `table[p // bs]`,
row `p % bs`. `prefix_cache.BlockPool` hands out and takes back whole blocks (shared between
sequences when they hold the same prefix).

One forward pass serves every scheduled sequence: the runner flattens the step into a single row
of T tokens (decode tokens first, one per running sequence, then the prompts being prefilled),
passes explicit `position_ids`, and hands the step's `attention.base.StepAttention` to the model
through the forward kwargs (`kv_meta=`), which transformers forwards to the registered attention
function. That function writes the step's keys and values into the pools, then runs each segment of
the step (decode rows, prompts from token 0, chunks after cached tokens: `attention/`) through the
backend the execution plan chose for its kind and the layer's variant (sliding window, soft-cap).

The model's layers compute q/k/v, norms and RoPE (their own forwards, or the fused ones of
`fused_layers.py`, whose rotary kernel also writes the cache rows); nothing here is model-specific
beyond the attention module exposing `layer_idx`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import AttentionInterface

from asyncgrpo.server.attention.base import StepAttention, variant_of

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
        self.k = [torch.zeros(shape if i in keep else 0, dtype=dtype, device=device)
                  for i in range(num_layers)]
        self.v = [torch.zeros(shape if i in keep else 0, dtype=dtype, device=device)
                  for i in range(num_layers)]
        self.num_blocks = num_blocks
        self.scratch_block = num_blocks
        self.block_size = block_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * num_kv_heads * head_dim * torch.empty(0, dtype=dtype).element_size()


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
    the caller did (`kv_written=True`: the fused attention forward writes them in its rotary kernel),
    then computes each segment with its backend for this layer's variant."""
    meta: StepAttention | None = kwargs.get("kv_meta")
    if meta is None:
        raise RuntimeError(
            f"attention implementation {ATTENTION_NAME!r} needs the step metadata (kv_meta=...); "
            "it only runs inside the embedded server's model runner"
        )
    layer = module.layer_idx
    cache = meta.cache
    q, k, v = query[0], key[0], value[0]
    flat = (-1, cache.num_kv_heads, cache.head_dim)
    k_pool, v_pool = cache.k[layer], cache.v[layer]
    if not kwargs.get("kv_written"):
        k_pool.view(flat).index_copy_(0, meta.slot_mapping, k.transpose(0, 1))
        v_pool.view(flat).index_copy_(0, meta.slot_mapping, v.transpose(0, 1))
    scale = scaling if scaling is not None else q.shape[-1] ** -0.5
    # per layer, from the model's attention module (Mistral, Qwen2, Gemma 2/3, Cohere2, ...)
    window, softcap = kwargs.get("sliding_window"), kwargs.get("softcap")
    variant = variant_of(window, softcap)
    parts, start = [], 0
    for segment in meta.segments:
        end = start + segment.num_tokens
        try:
            backend = meta.backends[segment.kind][variant]
        except KeyError:
            raise RuntimeError(f"the execution plan has no backend for {segment.kind!r} segments of "
                               f"layers with (window, soft-cap) {variant}: its probe saw no such "
                               "layer") from None
        parts.append(backend.forward(q[:, start:end], k[:, start:end], v[:, start:end], k_pool, v_pool,
                                     segment, scale, window, softcap))
        start = end
    out = parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)
    return out[None], None


def register_attention() -> str:
    """Register the paged attention with transformers (idempotent) and return its name."""
    AttentionInterface.register(ATTENTION_NAME, paged_attention_forward)
    return ATTENTION_NAME
