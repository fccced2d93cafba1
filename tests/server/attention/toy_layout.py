"""A toy layout for `test_attention_plan.py`: the whole of what a new kind of segment takes, in one file.

Prompts of a single token (from token 0) attend to that token alone, so their attention output is its
value (repeated over the query heads of each kv head): no mask, no cache read. This backend claims the
leading such chunks of a step, ahead of `fresh`; the test adds its one line to the probe's KINDS.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from asyncgrpo.server.attention.base import AttentionBackend, Chunks, Support
from asyncgrpo.server.attention.plan import Kind

ONE_TOKEN = "one_token"


@dataclass
class OneTokenPrompts:
    """Prompts of one token from token 0 (no device tensor at all)."""

    num_tokens: int

    kind = ONE_TOKEN


class OneTokenBackend(AttentionBackend):
    """Each token's own value: exact for a prompt of one token, whatever its window or soft-cap."""

    kind = ONE_TOKEN
    name = "one_token"
    support = Support(graphs=True)
    reads = OneTokenPrompts
    forwards = 0  # layers it computed (the test checks that the runner's steps went through it)

    def claims(self, chunks: Chunks) -> int:
        single = (chunks.starts == 0) & (chunks.lens == 1)
        return len(chunks) if single.all() else int(np.argmin(single))

    def build(self, chunks: Chunks, cache, device: torch.device) -> OneTokenPrompts:
        return OneTokenPrompts(len(chunks))

    def forward(self, q, k, v, k_pool, v_pool, segment: OneTokenPrompts, scale, window,
                softcap) -> torch.Tensor:
        type(self).forwards += 1
        return v.repeat_interleave(q.shape[0] // v.shape[0], dim=0).transpose(0, 1)  # [T, H, D]


LINE = Kind(ONE_TOKEN, (OneTokenBackend,), prompt=True)  # its line in the probe's KINDS, ahead of `fresh`
