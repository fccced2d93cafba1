"""Segment kind `fresh`: prompt chunks from token 0, each attending causally over its own new keys
(and within the layer's sliding window). They lead a step's chunks (the scheduler puts them first).

    packed  `FlashFresh`: the chunks stay packed for FlashAttention's variable-length kernel (CUDA,
            fp16/bf16, no soft-cap; `varlen.py`), nothing copied; `ReferencePackedFresh` computes the
            same on any device, only where the flags insist (CPU tests)
    padded  `PaddedFresh` (any device, every variant): one prompt attends as it is; several are padded
            into a [B, Lmax] batch (padding after each prompt, so the causal mask alone keeps real
            queries off it) and attend through SDPA, or `attend` where a window or a soft-cap needs an
            explicit mask
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from asyncgrpo.server.attention.base import (
    FRESH,
    HALF,
    AttentionBackend,
    Chunks,
    Probe,
    Support,
    Variant,
    pad_indices,
)
from asyncgrpo.server.attention.varlen import (
    ReferencePacked,
    VarlenChunks,
    flash_serves,
    flash_varlen,
    varlen_chunks,
)
from asyncgrpo.server.attention_math import attend, in_window
from asyncgrpo.server.host_copy import to_device


def leading_fresh(chunks: Chunks) -> int:
    """How many of the leading chunks start at token 0."""
    later = np.flatnonzero(chunks.starts != 0)
    return len(chunks) if len(later) == 0 else int(later[0])


@dataclass
class PaddedPrompts:
    """Padded layout of prompts from token 0 (device tensors unless noted)."""

    lens: list[int]  # host: tokens of each prompt, in order
    # [B * Lmax] int64 into the prompts' tokens (0 where padding); None: one prompt, attending as it is
    pad_index: torch.Tensor | None
    unpad_index: torch.Tensor | None  # [T] int64 into the padded [B * Lmax] layout

    kind = FRESH

    @property
    def num_tokens(self) -> int:
        return sum(self.lens)


class PaddedFresh(AttentionBackend):
    """Prompts from token 0 padded into a batch (any device, every variant)."""

    kind = FRESH
    name = "padded"
    reads = PaddedPrompts

    def claims(self, chunks: Chunks) -> int:
        return leading_fresh(chunks)

    def build(self, chunks: Chunks, cache, device: torch.device) -> PaddedPrompts:
        lens = chunks.lens.tolist()
        if len(lens) == 1:
            return PaddedPrompts(lens, None, None)
        pad, unpad = pad_indices(lens)
        return PaddedPrompts(lens, to_device(pad, device), to_device(unpad, device))

    def forward(self, q, k, v, k_pool, v_pool, segment: PaddedPrompts, scale, window,
                softcap) -> torch.Tensor:
        """q [H, Tp, D], k/v [KVH, Tp, D] -> [Tp, H, D]."""
        h, _, d = q.shape
        gqa = h != k.shape[0]
        plain = window is None and not softcap
        if segment.pad_index is None:
            if plain:
                out = F.scaled_dot_product_attention(q[None], k[None], v[None], is_causal=True, scale=scale,
                                                     enable_gqa=gqa)
            else:
                mask = causal_mask(q.shape[1], window, q.device)
                out = attend(q[None], k[None], v[None], mask, scale, softcap)
            return out[0].transpose(0, 1)
        bp, lmax = len(segment.lens), max(segment.lens)

        def pad(x: torch.Tensor) -> torch.Tensor:
            return x.index_select(1, segment.pad_index).view(x.shape[0], bp, lmax, d).transpose(0, 1)

        if plain:
            out = F.scaled_dot_product_attention(pad(q), pad(k), pad(v), is_causal=True, scale=scale,
                                                 enable_gqa=gqa)
        else:
            out = attend(pad(q), pad(k), pad(v), causal_mask(lmax, window, q.device), scale, softcap)
        return out.transpose(1, 2).reshape(bp * lmax, h, d).index_select(0, segment.unpad_index)


def causal_mask(n: int, window: int | None, device: torch.device) -> torch.Tensor:
    """[n, n] bool: query i sees keys j <= i inside its window."""
    pos = torch.arange(n, device=device)
    return (pos[None, :] <= pos[:, None]) & in_window(pos[:, None], pos[None, :], window)


class FlashFresh(AttentionBackend):
    """Prompts from token 0 packed for FlashAttention, over their own keys as the step computed them."""

    kind = FRESH
    name = "flash_varlen"
    support = Support(devices=frozenset({"cuda"}), dtypes=HALF, softcap=False)
    reads = VarlenChunks

    @classmethod
    def check(cls, probe: Probe, variant: Variant) -> bool:
        return flash_serves(probe, variant)

    def claims(self, chunks: Chunks) -> int:
        return leading_fresh(chunks)

    def build(self, chunks: Chunks, cache, device: torch.device) -> VarlenChunks:
        return varlen_chunks(chunks.lens, np.zeros_like(chunks.lens), None, cache.block_size, device)

    def forward(self, q, k, v, k_pool, v_pool, segment: VarlenChunks, scale, window, softcap) -> torch.Tensor:
        return self.packed(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), segment, scale, window)

    def packed(self, q, k, v, segment: VarlenChunks, scale: float, window: int | None) -> torch.Tensor:
        """Packed q [Tq, H, D], k/v [Tk, KVH, D] -> [Tq, H, D]."""
        return flash_varlen(q, k, v, segment, scale, window)


class ReferencePackedFresh(ReferencePacked, FlashFresh):
    """The packed layout of prompts from token 0 through `varlen_reference`: only where insisted on."""
