"""Recurrent token mixing on a tree-packed row: causal convolution and the chunked gated delta rule.

A Gated DeltaNet layer mixes tokens twice: a causal depthwise convolution of width W over the
projected q/k/v, then the gated delta rule, a linear recurrence whose state S (per head, K x V) is

    S_t = exp(g_t) S_{t-1} + k_t beta_t (v_t - exp(g_t) S_{t-1}^T k_t)^T,    o_t = S_t^T q_t

(q and k l2-normalised, q scaled by K^-1/2). On a packed row both must follow the trie, not the
row order (`tree.py`): segments are in depth-first order and a child attaches at the END of its
parent, so

- the convolution of a token reads the W - 1 tokens before it on its own root-to-token path: for
  the first tokens of a segment those are the last tokens of its parent (and, when the parent is
  shorter than W - 1, of its grandparents), never the row neighbour, which may be a sibling's
  subtree or another sample. `RecurrentLayout.conv_index` builds a conv input in which every
  segment is preceded by those path tokens (zeros above a root), so one plain causal convolution
  over it is exact for every token (`modeling/deltanet/layer.causal_conv1d_at`);
- the recurrence of a segment starts from its parent's FINAL state. The PyTorch backend runs the
  whole row at once (`modeling/deltanet/delta_rule.ChunkPlan`: every segment cut into chunks, a
  segment's first chunk one step after its parent's last). fla-core's kernel takes a varlen batch
  with one initial state per sequence, so that backend runs the row level by level: segments at the
  same depth of the segment tree are independent given their parents, and level d takes the final
  states of level d - 1 as initial states, one varlen call per level.

Everything here is pure: index plans from the row's segment arrays (numpy), and torch functions. The
math both steps run is shared with the embedded server (`modeling/deltanet/`); the trie walk, and the
choice of the fla-core backend, which only training uses, are here.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import threading
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from asyncgrpo.modeling.deltanet.delta_rule import (
    CHUNK_SIZE,
    ChunkPlan,
    grouped_query_key,
    l2_normalize,
    normalized_query_key,
    segment_tree_delta_rule,
)
from asyncgrpo.modeling.deltanet.layer import causal_conv1d_at
from asyncgrpo.packing.tree import concat_ranges

logger = logging.getLogger(__name__)

__all__ = [
    "DELTA_RULE_BACKENDS",
    "RecurrentLayout",
    "SegmentLevel",
    "resolve_delta_rule_backend",
    "tree_causal_conv1d",
    "tree_gated_delta_rule",
]

DELTA_RULE_BACKENDS = ("auto", "torch", "fla")


@dataclass(frozen=True, eq=False)
class SegmentLevel:
    """The segments of one depth of the segment tree (row order), as index tensors (fla's varlen calls).

    token_index: [N] packed index of the level's tokens, segment after segment.
    cu_seqlens: [n + 1] int64 offsets of the n segments inside `token_index`.
    parent_slot: [n] position of each segment's parent in the previous level (None at level 0).
    """

    token_index: torch.Tensor
    cu_seqlens: torch.Tensor
    parent_slot: torch.Tensor | None


@dataclass(frozen=True, eq=False)
class RecurrentLayout:
    """How recurrent layers walk one packed row of T tokens and S segments (tensors on one device).

    conv_index: [T + S (W - 1)] packed index of each conv input entry: per segment, in row order,
        the W - 1 tokens before its first token on its trie path (oldest first; T, a zero row,
        where the path is shorter), then its own tokens.
    conv_keep: [T] where each packed token sits in the conv input.
    levels: the segment tree's depths, root segments first (the fla backend's calls).
    level_order_inverse: [T] position of each packed token in the concatenation of the levels'
        `token_index` (it undoes the level order).
    chunks: the chunks of every segment and the order the PyTorch delta rule walks them.
    """

    num_tokens: int
    conv_width: int
    conv_index: torch.Tensor
    conv_keep: torch.Tensor
    levels: tuple[SegmentLevel, ...]
    level_order_inverse: torch.Tensor
    chunks: ChunkPlan

    @classmethod
    def build(cls, segment_parent, segment_start, segment_len, conv_width: int,
              device: torch.device | str | None = None) -> RecurrentLayout:
        """From a row's segment arrays (`PackedRow.segment_parent/start/len`, any device)."""
        parent = _numpy(segment_parent)
        start = _numpy(segment_start)
        length = _numpy(segment_len)
        num_segments = parent.size
        num_tokens = int(length.sum())
        if conv_width < 1:
            raise ValueError(f"conv_width must be >= 1, got {conv_width}")
        if num_segments == 0 or np.any(parent >= np.arange(num_segments)):
            raise ValueError(
                "segments must be in depth-first order, each after its parent (see packing/tree.py)")
        context = conv_width - 1
        segment_of_token = np.repeat(np.arange(num_segments), length)
        conv_keep = np.arange(num_tokens) + context * (segment_of_token + 1)
        conv_index = np.full(num_tokens + num_segments * context, num_tokens, dtype=np.int64)
        conv_index[conv_keep] = np.arange(num_tokens)
        level = np.zeros(num_segments, dtype=np.int64)
        for s in range(num_segments):
            p = int(parent[s])
            if p >= 0:
                level[s] = level[p] + 1
            if context:
                before = _path_tail(s, context, parent, start, length)
                base = int(start[s]) + context * s
                conv_index[base + context - before.size: base + context] = before

        levels, order, slot = [], [], np.zeros(num_segments, dtype=np.int64)
        for depth in range(int(level.max()) + 1):
            segments = np.flatnonzero(level == depth)
            slot[segments] = np.arange(segments.size)
            lens = length[segments]
            token_index = concat_ranges(start[segments], lens)
            cu = np.zeros(segments.size + 1, dtype=np.int64)
            np.cumsum(lens, out=cu[1:])
            parent_slot = slot[parent[segments]] if depth else None
            order.append(token_index)
            levels.append(SegmentLevel(
                token_index=_tensor(token_index, device),
                cu_seqlens=_tensor(cu, device),
                parent_slot=None if parent_slot is None else _tensor(parent_slot, device),
            ))
        inverse = np.empty(num_tokens, dtype=np.int64)
        inverse[np.concatenate(order)] = np.arange(num_tokens)
        return cls(num_tokens=num_tokens, conv_width=conv_width, conv_index=_tensor(conv_index, device),
                   conv_keep=_tensor(conv_keep, device), levels=tuple(levels),
                   level_order_inverse=_tensor(inverse, device),
                   chunks=ChunkPlan.build(parent, start, length, CHUNK_SIZE, device))


def _numpy(values) -> np.ndarray:
    if isinstance(values, torch.Tensor):
        values = values.detach().cpu().numpy()
    return np.asarray(values, dtype=np.int64)


def _tensor(array: np.ndarray, device) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(array, dtype=np.int64)).to(device)


def _path_tail(segment: int, count: int, parent, start, length) -> np.ndarray:
    """Packed indices of (at most) the `count` tokens before `segment` on its path, oldest first."""
    pieces, need, p = [], count, int(parent[segment])
    while need and p >= 0:
        take = min(need, int(length[p]))
        end = int(start[p] + length[p])
        pieces.append(np.arange(end - take, end))
        need -= take
        p = int(parent[p])
    return np.concatenate(pieces[::-1]) if pieces else np.zeros(0, dtype=np.int64)


def tree_causal_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                       layout: RecurrentLayout, activation: str | None = "silu") -> torch.Tensor:
    """Depthwise causal convolution of each token over its trie path. x [T, C], weight [C, W],
    bias [C] or None; returns [T, C] in x's dtype (computed in weight's dtype, like transformers)."""
    channels, width = weight.shape
    if width != layout.conv_width:
        raise ValueError(f"the layout was built for convolution width {layout.conv_width}, the weight has "
                         f"{width}")
    # index_select, not x[index]: its backward adds with index_add_ instead of sorting the index
    padded = torch.cat([x, x.new_zeros(1, channels)]).index_select(0, layout.conv_index)  # [T + S (W - 1), C]
    return causal_conv1d_at(padded, layout.conv_keep, weight, bias, activation)


@dataclass(frozen=True)
class DeltaRuleShape:
    """What fla-core compiles and tunes its kernels for: value heads (q/k heads reach the kernel
    expanded to them), head sizes and dtype."""

    heads: int = 2
    key_dim: int = 64
    value_dim: int = 64
    dtype: torch.dtype = torch.bfloat16


def resolve_delta_rule_backend(backend: str, device: torch.device,
                               shape: DeltaRuleShape = DeltaRuleShape()) -> str:
    """"auto": fla-core's Triton kernel on CUDA where it imports and its training check passes at the
    layer's `shape`, else the PyTorch path."""
    if backend not in DELTA_RULE_BACKENDS:
        raise ValueError(f"delta rule backend must be one of {DELTA_RULE_BACKENDS}, got {backend!r}")
    if backend == "torch":
        return backend
    if device.type != "cuda":
        if backend == "fla":
            raise ValueError("the 'fla' delta rule backend runs on CUDA only; use 'auto' or 'torch' on "
                             f"{device.type}")
        return "torch"
    kernel, reason = _fla_kernel()
    if kernel is None:
        if backend == "fla":
            raise ValueError(f"the 'fla' delta rule backend needs fla-core: {reason}")
        _log_fallback_once(reason)
        return "torch"
    if backend == "auto":
        reason = _fla_training_problem(
            device.index if device.index is not None else torch.cuda.current_device(), shape)
        if reason is not None:
            _log_fallback_once(reason)
            return "torch"
    _log_fla_first_use_once()
    return "fla"


@functools.cache
def _fla_kernel():
    """(fla's chunk_gated_delta_rule, None), or (None, why not)."""
    if importlib.util.find_spec("fla") is None:
        return None, "fla-core is not installed (pip install fla-core)"
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule as kernel
    except ImportError as err:  # installed without what it needs (Triton, a submodule): say why
        return None, f"importing fla-core failed: {type(err).__name__}: {err}"
    return kernel, None


@functools.cache
def _fla_training_problem(device_index: int, shape: DeltaRuleShape = DeltaRuleShape()) -> str | None:
    """Why fla-core's delta rule cannot train on this GPU, or None. fla refuses some Triton / GPU pairs
    in the backward pass only (Triton 3.4 to 3.7.0 on Hopper miscompiles one of its kernels), so a
    short forward + backward finds out once, before a training step would fail. It runs at the layer's
    own shape: fla-core tunes its kernels per shape (about 100 s on an H200), and those are the ones
    training then uses."""
    return run_isolated(_fla_check, device_index, shape)


def run_isolated(fn, *args):
    """fn(*args) on a fresh thread, so that the caller's autograd state does not apply to it: grad mode,
    and above all the saved-tensor hooks of activation checkpointing. A check that runs its own backward
    from inside a checkpointed forward would otherwise change what the checkpoint saves, and the
    recomputation (which skips the cached check) would no longer match it."""
    result = {}

    def target():
        try:
            result["value"] = fn(*args)
        except BaseException as err:  # noqa: BLE001 - re-raised on the caller's thread
            result["error"] = err

    thread = threading.Thread(target=target, name="asyncgrpo-isolated-check")
    thread.start()
    thread.join()
    if "error" in result:
        raise result["error"]
    return result["value"]


def _fla_check(device_index: int, shape: DeltaRuleShape) -> str | None:
    kernel, _ = _fla_kernel()
    device = torch.device("cuda", device_index)
    gen = torch.Generator(device=device).manual_seed(0)

    def randn(*size):
        return torch.randn(*size, device=device, generator=gen).to(shape.dtype).requires_grad_()

    h = shape.heads
    q, k, v = randn(1, 80, h, shape.key_dim), randn(1, 80, h, shape.key_dim), randn(1, 80, h, shape.value_dim)
    g = F.logsigmoid(torch.randn(1, 80, h, device=device, generator=gen)).requires_grad_()
    beta = torch.rand(1, 80, h, device=device, generator=gen).to(shape.dtype).requires_grad_()
    cu_seqlens = torch.tensor([0, 30, 80], device=device)
    try:
        out, _ = kernel(q, k, v, g, beta, output_final_state=True, cu_seqlens=cu_seqlens)
        out.float().sum().backward()
    except Exception as err:  # noqa: BLE001 - any failure means: use the PyTorch path, and say why
        return (f"fla-core's delta rule failed a forward + backward check on this GPU: "
                f"{type(err).__name__}: {err}")
    return None


@functools.cache
def _log_fla_first_use_once() -> None:
    logger.info("Gated DeltaNet layers run fla-core's Triton kernels; the first steps compile and autotune "
                "them (minutes on a fresh machine, e.g. about 5 at the Qwen3.5-2B shape on an H200; Triton "
                "keeps the compiled kernels on disk for later runs)")


@functools.cache
def _log_fallback_once(reason: str) -> None:
    logger.warning("Gated DeltaNet layers run the pure-PyTorch chunked delta rule on CUDA (slower): %s",
                   reason)


def tree_gated_delta_rule(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, g: torch.Tensor,
                          beta: torch.Tensor, layout: RecurrentLayout,
                          backend: str = "torch") -> torch.Tensor:
    """The gated delta rule over a packed row, each segment starting from its parent's final state.

    query/key [T, Hk, K] (raw: l2-normalised and scaled here), value [T, H, V] with H a multiple of
    Hk (grouped value heads), g and beta [T, H]. backend "torch" or "fla" (a resolved backend).
    Returns [T, H, V] in value's dtype.
    """
    if backend == "torch":
        # grouped q/k heads stay grouped: the chunk gather reads each value head's q/k head
        query, key = normalized_query_key(query, key, query.shape[-2])
        out, _ = segment_tree_delta_rule(query, key, value, g, beta, layout.chunks)
        return out.to(value.dtype)
    if backend != "fla":
        raise ValueError(f"tree_gated_delta_rule backend must be 'torch' or 'fla', got {backend!r}")
    # l2-normalised here (float32, stored back in the input dtype, as fla's own l2norm does) rather
    # than in fla's kernel: its l2norm kernels autotune again for every new size bucket of a level
    query, key = (l2_normalize(x.to(torch.promote_types(x.dtype, torch.float32))).to(x.dtype)
                  for x in (query, key))
    query, key = grouped_query_key(query, key, value.shape[-2])
    outputs, final_states = [], None
    last = len(layout.levels) - 1
    for depth, level in enumerate(layout.levels):
        initial = None if level.parent_slot is None else final_states.index_select(0, level.parent_slot)
        out, final_states = _fla_level(query, key, value, g, beta, level, initial, depth < last)
        outputs.append(out)
    return torch.cat(outputs).index_select(0, layout.level_order_inverse).to(value.dtype)


def _fla_level(query, key, value, g, beta, level: SegmentLevel, initial, keep_final):
    """One level as varlen sequences in one fla kernel call (B = 1, cu_seqlens)."""
    kernel, reason = _fla_kernel()
    if kernel is None:
        raise RuntimeError(f"the fla delta rule backend was chosen but fla-core cannot run: {reason}")
    query, key, value, g, beta = (x.index_select(0, level.token_index)[None]
                                  for x in (query, key, value, g, beta))
    out, final = kernel(query, key, value, g, beta, initial_state=initial, output_final_state=keep_final,
                        use_qk_l2norm_in_kernel=False, cu_seqlens=level.cu_seqlens)
    return out[0], final
