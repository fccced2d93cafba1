"""Tree packing: samples -> rows (batcher) -> prefix-trie rows (tree) -> tree attention."""

from asyncgrpo.modeling.support import SUPPORTED_MODEL_TYPES, check_supported  # public here too (README)
from asyncgrpo.packing.batcher import MicroBatch, TokenBudgetBatcher
from asyncgrpo.packing.tree import PackedRow, Sample, pack_row, sample_paths, unpack_token_ids

__all__ = [
    "SUPPORTED_MODEL_TYPES",
    "MicroBatch",
    "PackedRow",
    "Sample",
    "TokenBudgetBatcher",
    "check_supported",
    "pack_row",
    "sample_paths",
    "unpack_token_ids",
]
