"""Tree attention: a transformers attention implementation for tree-packed rows.

Token i sees token j iff j's segment is an ancestor-or-self of i's segment and j <= i. Segments are
in depth-first preorder with children attached at their parent's end (see `tree.py`), so this is

    visible(i, j) = j <= i < span_end[j]        (span_end = end of the subtree of j's segment)

plus, on sliding-window layers, `position_ids[i] - position_ids[j] < window` (the window is measured
in trie depth, as the model sees it when forwarding the sample alone; transformers' own rule).

Backends:
- "flex" (CUDA): `torch.compile`d FlexAttention with a BlockMask built directly from the segment
  spans (no T x T evaluation), once per row and window and shared by all layers;
- "dense" (CPU and anything else): SDPA with a dense boolean T x T mask (FlexAttention has no CPU
  backward). Exact, O(T^2) memory: meant for tests and the tiny CPU model.

How the row reaches the layers: the trainer wraps the forward in `tree_attention_context(mask)`;
`enable_tree_attention` installed forward pre-hooks (on the model and on its base model) that copy
the active mask into the model's keyword arguments, and transformers passes unknown keyword
arguments down to the attention function. Gradient checkpointing captures them, so recomputation in
the backward pass (possibly in another thread, after the context exited) sees the same row. Nothing
global outlives the context.
The model's own mask creation returns None for an implementation without a registered mask
function (transformers 5.x `_preprocess_mask_arguments`), so no dense causal mask is ever built.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from asyncgrpo.modeling.load import turn_off_hub_kernels
from asyncgrpo.modeling.support import check_supported
from asyncgrpo.packing.deltanet import disable_tree_deltanet, enable_tree_deltanet
from asyncgrpo.packing.recurrent import DELTA_RULE_BACKENDS, RecurrentLayout
from asyncgrpo.packing.tree import PackedRow

logger = logging.getLogger(__name__)

__all__ = [
    "TREE_ATTENTION",
    "TreeMask",
    "active_tree_mask",
    "attention_windows",
    "disable_tree_attention",
    "enable_tree_attention",
    "tree_attention_context",
    "tree_attention_forward",
]

TREE_ATTENTION = "asyncgrpo_tree"
_MASK_KWARG = "tree_mask"
_HOOK_ATTR = "_asyncgrpo_tree_attention_hook"
_NOT_PASSED = object()
_ACTIVE_MASK: contextvars.ContextVar[TreeMask | None] = contextvars.ContextVar("asyncgrpo_tree_mask",
                                                                                default=None)


@dataclass(eq=False)
class TreeMask:
    """The structure of one packed row as the model's layers see it, on the device of the forward.

    position_ids: [T] trie depth of each token; span_end: [T] exclusive end of the subtree of each
    token's segment. Masks are built lazily, once per sliding window, and cached on the object.
    segment_parent / segment_start / segment_len: the row's segments ([S], `PackedRow`), which the
    recurrent layers of hybrid models walk (`recurrent_layout`); deltanet_backend: their delta rule
    kernel, "auto" (fla-core on CUDA where installed), "torch" or "fla".
    mask_capacity: on the flex backend, the per-token tensors the mask function reads are padded to
    this many tokens and marked static, so that layers compiled for any row length capture no
    symbolic size in it (FlexAttention's FLASH backend refuses one); None: the row's own length.
    kernel_options: FlexAttention's kernel_options for the row's attention, e.g. {"BACKEND": "FLASH"}
    (FlashAttention-4, from the flash-attn-4 package); None: its Triton kernels. They travel with the
    mask, not with the code around the forward, because activation checkpointing recomputes the forward
    inside backward, wherever that runs: a recomputation under other kernels gave wrong gradients.
    """

    position_ids: torch.Tensor
    span_end: torch.Tensor
    backend: str = "dense"
    block_size: int = 128
    segment_parent: torch.Tensor | None = None
    segment_start: torch.Tensor | None = None
    segment_len: torch.Tensor | None = None
    deltanet_backend: str = "auto"
    mask_capacity: int | None = None
    kernel_options: dict | None = None
    _cache: dict = field(default_factory=dict, repr=False)

    def __post_init__(self):
        if self.backend not in ("flex", "dense"):
            raise ValueError(f"TreeMask.backend must be 'flex' or 'dense', got {self.backend!r}")
        if self.deltanet_backend not in DELTA_RULE_BACKENDS:
            raise ValueError(f"TreeMask.deltanet_backend must be one of {DELTA_RULE_BACKENDS}, "
                             f"got {self.deltanet_backend!r}")
        if self.mask_capacity is not None and self.mask_capacity < self.num_tokens:
            raise ValueError(f"TreeMask.mask_capacity={self.mask_capacity} is below the row's "
                             f"{self.num_tokens} tokens; give at least the longest row's length (the token "
                             "budget), or None")

    @classmethod
    def from_row(cls, row: PackedRow, device: torch.device | str | None = None, backend: str = "auto",
                 block_size: int = 128, min_flex_tokens: int = 512, deltanet_backend: str = "auto",
                 mask_capacity: int | None = None, kernel_options: dict | None = None) -> TreeMask:
        """backend "auto": "flex" on CUDA for rows of at least `min_flex_tokens` tokens, else "dense".
        Short rows gain nothing from block sparsity, and compiled FlexAttention failed to lower for a
        102-token row on torch 2.11 / H200 (queries shorter than one block take its decoding path)."""
        device = torch.device(device) if device is not None else row.input_ids.device
        if backend == "auto":
            backend = "flex" if device.type == "cuda" and row.num_tokens >= min_flex_tokens else "dense"
        span_end = row.segment_subtree_end[row.segment_ids]
        return cls(position_ids=row.position_ids.to(device), span_end=span_end.to(device), backend=backend,
                   block_size=block_size, segment_parent=row.segment_parent, segment_start=row.segment_start,
                   segment_len=row.segment_len, deltanet_backend=deltanet_backend,
                   mask_capacity=mask_capacity, kernel_options=kernel_options)

    def recurrent_layout(self, conv_width: int) -> RecurrentLayout:
        """The index plan of the row's recurrent layers (`packing/recurrent.py`), cached per width."""
        key = ("recurrent", conv_width)
        if key not in self._cache:
            if self.segment_parent is None:
                raise ValueError("this TreeMask has no segments, which recurrent (Gated DeltaNet) layers "
                                 "need: build it with TreeMask.from_row(row, device)")
            self._cache[key] = RecurrentLayout.build(self.segment_parent, self.segment_start,
                                                     self.segment_len, conv_width, self.position_ids.device)
        return self._cache[key]

    @property
    def num_tokens(self) -> int:
        return int(self.position_ids.numel())

    def visible(self, q_idx: torch.Tensor, kv_idx: torch.Tensor, window: int | None) -> torch.Tensor:
        """Elementwise rule (broadcasting index tensors); also the FlexAttention mask_mod body."""
        seen = (kv_idx <= q_idx) & (q_idx < self.span_end[kv_idx])
        if window is not None:
            seen = seen & (self.position_ids[q_idx] - self.position_ids[kv_idx] < window)
        return seen

    def dense(self, window: int | None = None) -> torch.Tensor:
        """[T, T] bool, True where query row i may attend key column j."""
        key = ("dense", window)
        if key not in self._cache:
            idx = torch.arange(self.num_tokens, device=self.span_end.device)
            self._cache[key] = self.visible(idx[:, None], idx[None, :], window)
        return self._cache[key]

    def block_mask(self, window: int | None = None) -> BlockMask:
        """FlexAttention BlockMask [1, 1, T, T] classified from per-block span and depth bounds."""
        key = ("block", window)
        if key not in self._cache:
            self._cache[key] = _tree_block_mask(self, window)
        return self._cache[key]

    def prebuild(self, windows: tuple[int | None, ...]) -> None:
        """Build the masks of these windows now (the backend's kind), so that compiled layers only read
        the cache: no graph holds mask construction, and every layer shares one mask per window."""
        for window in windows:
            if self.backend == "flex":
                self.block_mask(window)
            else:
                self.dense(window)


def _tree_block_mask(mask: TreeMask, window: int | None) -> BlockMask:
    """Block (qb, kb) is visited iff some pair in it is visible, and skips mask_mod ("full") iff all
    pairs are. Without a window both are exact: with kb <= qb, a key j reaches the query block iff
    span_end[j] > first query; all pairs are visible iff kb < qb and min span_end > last query.
    The window test uses per-block depth bounds (conservative: it only turns full into partial)."""
    size, total = mask.block_size, mask.num_tokens
    num_blocks = -(-total // size)
    device = mask.span_end.device
    pad = num_blocks * size - total
    span = F.pad(mask.span_end, (0, pad), value=-1).view(num_blocks, size)
    span_max = span.amax(1)
    span_min = F.pad(mask.span_end, (0, pad), value=total + 1).view(num_blocks, size).amin(1)
    block = torch.arange(num_blocks, device=device)
    q_first = block * size
    q_last = torch.clamp(q_first + size, max=total) - 1
    kb, qb = block[None, :], block[:, None]
    any_pair = (kb <= qb) & (span_max[None, :] > q_first[:, None])
    all_pairs = (kb < qb) & (span_min[None, :] > q_last[:, None])
    if window is not None:
        depth = mask.position_ids
        big = torch.iinfo(depth.dtype).max // 4
        depth_max = F.pad(depth, (0, pad), value=-big).view(num_blocks, size).amax(1)
        depth_min = F.pad(depth, (0, pad), value=big).view(num_blocks, size).amin(1)
        any_pair &= (depth_min[:, None] - depth_max[None, :]) < window
        all_pairs &= (depth_max[:, None] - depth_min[None, :]) < window
    partial = any_pair & ~all_pairs

    def to_indices(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        counts = blocks.sum(-1, dtype=torch.int32)
        indices = torch.argsort(blocks.to(torch.int8), dim=-1, descending=True, stable=True).to(torch.int32)
        return counts[None, None], indices[None, None]

    # The closure holds only tensors and an int, so a compiled FlexAttention sees the same graph for
    # every row (new rows change tensor values and sizes, not the traced code).
    span_end, depth = mask.span_end, mask.position_ids
    if mask.mask_capacity is not None:
        span_end, depth = (_static_padded(span_end, mask.mask_capacity),
                           _static_padded(depth, mask.mask_capacity))
    if window is None:
        def mask_mod(b, h, q_idx, kv_idx):
            return (kv_idx <= q_idx) & (q_idx < span_end[kv_idx])
    else:
        def mask_mod(b, h, q_idx, kv_idx):
            return (kv_idx <= q_idx) & (q_idx < span_end[kv_idx]) & (depth[q_idx] - depth[kv_idx] < window)

    kv_num, kv_idx = to_indices(partial)
    full_num, full_idx = to_indices(all_pairs)
    return BlockMask.from_kv_blocks(kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=size, mask_mod=mask_mod,
                                    seq_lengths=(total, total))


def _static_padded(values: torch.Tensor, capacity: int) -> torch.Tensor:
    """`values` padded with zeros to `capacity` entries, its size marked static for dynamo (the mask
    function only reads entries below the row's length)."""
    padded = F.pad(values, (0, capacity - values.numel()))
    torch._dynamo.mark_static(padded, 0)
    return padded


@functools.cache
def _compiled_flex_attention():
    return torch.compile(flex_attention)


def tree_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None | object = _NOT_PASSED,
    softcap: float | None = None,
    s_aux: torch.Tensor | None = None,
    position_bias: torch.Tensor | None = None,
    tree_mask: TreeMask | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Attention over one tree-packed row. query [1, Hq, T, D], key/value [1, Hkv, T, D];
    returns ([1, T, Hq, D], None) like every transformers attention function."""
    if tree_mask is None:
        raise RuntimeError("tree attention has no row: run the forward inside "
                           "`with tree_attention_context(TreeMask.from_row(row, device)):`")
    if s_aux is not None or position_bias is not None:
        raise ValueError(f"{type(module).__name__} uses attention sinks or a position bias, which tree "
                         "attention cannot run exactly; check_supported() should have refused this model")
    batch, _, length, _ = query.shape
    if batch != 1 or length != tree_mask.num_tokens:
        raise ValueError(f"tree attention runs one packed row of {tree_mask.num_tokens} tokens, got query "
                         f"batch {batch} x {length} tokens; pass input_ids/position_ids of shape [1, T]")
    # A model that passes no window at all (Qwen2-MoE) keeps it on the module; one that passes None
    # (Exaone4's full layers) means no window even if the module has one.
    window = getattr(module, "sliding_window", None) if sliding_window is _NOT_PASSED else sliding_window
    if tree_mask.backend == "flex":
        out = _flex_forward(query, key, value, tree_mask, scaling, dropout, window, softcap)
    else:
        out = _dense_forward(query, key, value, tree_mask, scaling, dropout, window, softcap)
    return out.transpose(1, 2).contiguous(), None


def _repeat_kv(x: torch.Tensor, num_heads: int) -> torch.Tensor:
    return x.repeat_interleave(num_heads // x.shape[1], dim=1) if x.shape[1] != num_heads else x


def _dense_forward(query, key, value, tree_mask, scaling, dropout, window, softcap):
    mask = tree_mask.dense(window)
    num_heads = query.shape[1]
    if softcap is None:
        return F.scaled_dot_product_attention(query, _repeat_kv(key, num_heads), _repeat_kv(value, num_heads),
                                              attn_mask=mask, dropout_p=dropout, scale=scaling)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    scores = torch.matmul(query, _repeat_kv(key, num_heads).transpose(2, 3)) * scale
    scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    probs = F.dropout(probs, p=dropout, training=dropout > 0)
    return torch.matmul(probs, _repeat_kv(value, num_heads))


def _flex_forward(query, key, value, tree_mask, scaling, dropout, window, softcap):
    if dropout > 0:
        raise ValueError("tree attention on FlexAttention has no attention dropout; set the model config's "
                         "attention_dropout to 0.0")
    score_mod = None
    if softcap is not None:
        def score_mod(score, b, h, q_idx, kv_idx):
            return torch.tanh(score / softcap) * softcap
    num_heads = query.shape[1]
    enable_gqa = key.shape[1] != num_heads
    if enable_gqa and num_heads & (num_heads - 1):  # FlexAttention's GQA wants power-of-two heads
        key, value, enable_gqa = _repeat_kv(key, num_heads), _repeat_kv(value, num_heads), False
    compiled = query.device.type != "cpu" and not torch.compiler.is_compiling()
    attend = _compiled_flex_attention() if compiled else flex_attention
    return attend(query, key, value, score_mod=score_mod, block_mask=tree_mask.block_mask(window),
                  scale=scaling, enable_gqa=enable_gqa, kernel_options=tree_mask.kernel_options)


def active_tree_mask() -> TreeMask | None:
    """The row of the innermost `tree_attention_context`, or None outside one."""
    return _ACTIVE_MASK.get()


def attention_windows(model: torch.nn.Module) -> tuple[int | None, ...]:
    """The windows the model's attention layers may pass to tree attention: None (full attention),
    each attention module's `sliding_window` and the config's. A window listed but unused costs one
    mask build per row; one missing is built on first use instead."""
    windows: set[int | None] = {None}
    for module in model.modules():
        if (type(module).__name__.endswith("Attention")
                and isinstance(getattr(module, "sliding_window", None), int)):
            windows.add(module.sliding_window)
    config = _pretrained_core(model).config.get_text_config()
    if isinstance(getattr(config, "sliding_window", None), int) and (
            "sliding_attention" in (getattr(config, "layer_types", None) or ())
            or getattr(config, "use_sliding_window", True)):
        windows.add(config.sliding_window)
    return tuple(sorted(windows, key=lambda w: -1 if w is None else w))


@contextlib.contextmanager
def tree_attention_context(mask: TreeMask) -> Iterator[TreeMask]:
    """Make `mask` the row of every forward of a tree-attention model inside this block."""
    token = _ACTIVE_MASK.set(mask)
    try:
        yield mask
    finally:
        _ACTIVE_MASK.reset(token)


def _inject_active_mask(module, args, kwargs):
    mask = _ACTIVE_MASK.get()
    if mask is not None and _MASK_KWARG not in kwargs:
        kwargs[_MASK_KWARG] = mask
    return args, kwargs


def _pretrained_core(model: torch.nn.Module):
    from transformers import PreTrainedModel

    for module in model.modules():  # the model itself, or the one inside a PEFT wrapper
        if isinstance(module, PreTrainedModel):
            return module
    raise TypeError(f"enable_tree_attention needs a transformers PreTrainedModel, got {type(model).__name__}")


def enable_tree_attention(model: torch.nn.Module) -> None:
    """Switch a loaded model (or a PEFT wrapper of one) to tree attention, after `check_supported`; the
    Gated DeltaNet layers of a hybrid model get their tree-packed forward (`deltanet.py`)."""
    from transformers import AttentionInterface

    core = _pretrained_core(model)
    check_supported(core.config)
    turn_off_hub_kernels(model)  # they would take the tree-packed DeltaNet forward back at train()
    if TREE_ATTENTION not in AttentionInterface._global_mapping:
        AttentionInterface.register(TREE_ATTENTION, tree_attention_forward)
    core.set_attn_implementation(TREE_ATTENTION)
    if core.config._attn_implementation != TREE_ATTENTION:
        raise ValueError(f"model type {core.config.model_type!r} ({type(core).__name__}) does not route "
                         "its attention through transformers' AttentionInterface, so tree attention "
                         "cannot run it")
    # Hook every transformers model inside (the CausalLM and its base model), so the row reaches the
    # layers whether the trainer calls `model(...)` or `model.model(...)` for hidden states.
    from transformers import PreTrainedModel

    for module in model.modules():
        if isinstance(module, PreTrainedModel) and getattr(module, _HOOK_ATTR, None) is None:
            setattr(module, _HOOK_ATTR,
                    module.register_forward_pre_hook(_inject_active_mask, with_kwargs=True))
    text_config = core.config.get_text_config()
    enable_tree_deltanet(model, expected=list(getattr(text_config, "layer_types", None) or ()).count(
        "linear_attention"), active_row=_ACTIVE_MASK.get)
    logger.info("tree attention enabled for %s", type(core).__name__)


def disable_tree_attention(model: torch.nn.Module, attn_implementation: str = "sdpa") -> None:
    """Undo `enable_tree_attention`: remove the hook, restore the Gated DeltaNet layers' own forwards, switch
    to `attn_implementation`."""
    for module in model.modules():
        handle = getattr(module, _HOOK_ATTR, None)
        if handle is not None:
            handle.remove()
            setattr(module, _HOOK_ATTR, None)
    disable_tree_deltanet(model)
    _pretrained_core(model).set_attn_implementation(attn_implementation)
