"""Automatic prefix caching: the KV-block pool, with full blocks content-addressed and shared.

A full block (block_size tokens) is named by a hash of its tokens chained with the hash of the block
before it, so a hash names the whole prefix up to the end of that block (as vLLM does):

    hash[0] = H(ROOT, tokens[0:bs])      hash[i] = H(hash[i-1], tokens[i*bs:(i+1)*bs])

Every block of the pool is in one of three states:

    in use    ref > 0              held by one or more running sequences (a shared prefix: ref > 1)
    cached    ref == 0, hashed     its KV stays valid for a later request; evictable, LRU order
    free      ref == 0, no hash    nothing worth keeping

`allocate` takes free blocks first and then evicts the least recently released cached blocks;
`match` finds the longest run of cached blocks for a request's block hashes (`match_tail`: the
longest prefix whose last blocks are cached, all that a sliding-window model reads), and `touch`
takes a reference on them. A sequence's blocks are released tail first, so that a prefix outlives the
blocks that follow it. Cached KV is only valid for the weights that computed it: `invalidate`
(a weight update) forgets every hash and bumps `epoch`; a block computed under an older epoch is
never registered (see `Scheduler`). The pool is plain Python, touched by the engine thread only.
"""

from __future__ import annotations

import collections
import hashlib
import logging
from collections.abc import Sequence

import numpy as np

logger = logging.getLogger(__name__)

ROOT_HASH = b"asyncgrpo-prefix-cache-v1"

# layer types whose state is not all in the paged KV cache (recurrent or convolutional mixing): a
# cached KV prefix alone cannot resume them, so such models are served without prefix caching
_KV_LAYER_TYPES = frozenset({"full_attention", "sliding_attention"})


def hash_block(parent: bytes, tokens: Sequence[int]) -> bytes:
    """Hash of one full block chained with its parent's hash (16 bytes, blake2b)."""
    return _chained(parent, np.asarray(tokens, dtype=np.int64).tobytes())


def _chained(parent: bytes, block: bytes) -> bytes:
    h = hashlib.blake2b(parent, digest_size=16)
    h.update(block)
    return h.digest()


def extend_block_hashes(
    hashes: list[bytes], tokens: Sequence[int], block_size: int, num_blocks: int, root: bytes = ROOT_HASH
) -> list[bytes]:
    """Extend `hashes` (those of the first len(hashes) blocks of `tokens`) in place to the first
    `num_blocks` full blocks, and return it. `tokens` must hold num_blocks * block_size tokens.
    `root` starts the chain (a LoRA adapter's own root keeps its KV apart from the base model's)."""
    assert len(tokens) >= num_blocks * block_size, (len(tokens), num_blocks, block_size)
    first = len(hashes)
    if first >= num_blocks:
        return hashes
    # the new blocks' bytes at once (hash_block's per-block conversion costs more than the hashing)
    data = np.asarray(tokens[first * block_size : num_blocks * block_size], dtype=np.int64).tobytes()
    step = block_size * 8
    parent = hashes[-1] if first else root
    for i in range(num_blocks - first):
        parent = _chained(parent, data[i * step : (i + 1) * step])
        hashes.append(parent)
    return hashes


def unsupported_layer_types(text_config) -> list[str]:
    """Layer types of a model config whose state the KV cache does not hold (empty: cacheable)."""
    return sorted(set(getattr(text_config, "layer_types", None) or ()) - _KV_LAYER_TYPES)


def prefix_caching_enabled(requested: bool, text_config) -> bool:
    """Whether to serve with prefix caching: as requested, except for models with layers whose state
    is not in the KV cache (the server logs why)."""
    other = unsupported_layer_types(text_config)
    if requested and other:
        logger.warning(
            "prefix caching is off for this model: its %s layers keep a recurrent state outside the paged "
            "KV cache, which a cached prefix cannot restore; every request is prefilled in full",
            ", ".join(other),
        )
        return False
    logger.info("prefix caching %s", "on" if requested else "off (--no-enable-prefix-caching)")
    return requested


class PrefixCacheStats:
    """Cumulative counters, in tokens, as vLLM's vllm:prefix_cache_queries / _hits."""

    def __init__(self) -> None:
        self.queries = 0  # tokens of the prompts looked up
        self.hits = 0  # of those, tokens found in the cache


class BlockPool:
    """KV blocks with reference counts and (when `enable_caching`) a content-addressed LRU cache.

    Without caching it is a plain free list: `match` finds nothing and `register` keeps nothing."""

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.epoch = 0  # bumped by invalidate(): KV computed before then is never registered
        self.stats = PrefixCacheStats()
        self._ref = [0] * num_blocks
        self._hash: list[bytes | None] = [None] * num_blocks
        self._by_hash: dict[bytes, int] = {}
        self._free = list(range(num_blocks - 1, -1, -1))  # unhashed, ref 0 (a stack: low ids first)
        # hashed, ref 0, LRU first
        self._evictable: collections.OrderedDict[int, None] = collections.OrderedDict()

    @property
    def num_free(self) -> int:
        """Blocks an allocation may take (free plus evictable cached ones)."""
        return len(self._free) + len(self._evictable)

    @property
    def num_cached(self) -> int:
        """Blocks that hold a registered prefix (in use or not)."""
        return len(self._by_hash)

    def allocate(self, n: int) -> list[int]:
        """n fresh blocks (ref 1, no hash): free ones first, then the least recently used cached ones."""
        assert n <= self.num_free, f"asked for {n} blocks, {self.num_free} free"
        take = min(n, len(self._free))
        out = self._free[len(self._free) - take :][::-1]
        del self._free[len(self._free) - take :]
        for _ in range(n - take):
            block, _ = self._evictable.popitem(last=False)
            del self._by_hash[self._hash[block]]
            self._hash[block] = None
            out.append(block)
        for block in out:
            self._ref[block] = 1
        return out

    def free(self, blocks: Sequence[int]) -> None:
        """Drop one reference to each block of a sequence; a block nobody holds becomes cached
        (hashed) or free. The tail goes first, so the sequence's last blocks are evicted first."""
        for block in reversed(blocks):
            self._ref[block] -= 1
            assert self._ref[block] >= 0, f"block {block} freed more often than taken"
            if self._ref[block] == 0:
                if self._hash[block] is None:
                    self._free.append(block)
                else:
                    self._evictable[block] = None

    def match(self, hashes: Sequence[bytes]) -> list[int]:
        """The blocks of the longest cached prefix of `hashes` (no reference taken)."""
        if not self.enable_caching:
            return []
        out = []
        for h in hashes:
            block = self._by_hash.get(h)
            if block is None:
                break
            out.append(block)
        return out

    def match_tail(self, hashes: Sequence[bytes], tail: int) -> tuple[int, list[int]]:
        """The longest hit of a sliding-window model, whose next token reads nothing before the last
        `tail` blocks of its prefix: the largest n <= len(hashes) such that blocks n - tail .. n - 1 are
        cached (or, when n < tail, blocks 0 .. n - 1). Returns (n, those blocks); no reference taken.
        Blocks before them may have been evicted: the chained hashes still vouch for the whole prefix."""
        if not self.enable_caching:
            return 0, []
        run: list[int] = []  # cached blocks from i rightwards, nearest to i last
        for i in range(len(hashes) - 1, -1, -1):
            block = self._by_hash.get(hashes[i])
            if block is None:
                run = []
                continue
            run.append(block)
            if len(run) == tail:
                return i + tail, run[::-1]
        return len(run), run[::-1]  # a run shorter than `tail` counts only from block 0

    def num_evictable(self, blocks: Sequence[int]) -> int:
        """How many of these (cached) blocks nobody holds: touching them lowers `num_free`."""
        return sum(1 for b in blocks if self._ref[b] == 0)

    def touch(self, blocks: Sequence[int]) -> None:
        """Take a reference to cached blocks found by `match`."""
        for block in blocks:
            if self._ref[block] == 0:
                del self._evictable[block]
            self._ref[block] += 1

    def register(self, block: int, block_hash: bytes) -> None:
        """Name an in-use block whose KV is (or is being, in this step) computed for the prefix
        `block_hash`. A hash already held by another block is left there (this block stays unnamed)."""
        if not self.enable_caching or block_hash in self._by_hash:
            return
        assert self._ref[block] > 0 and self._hash[block] is None, (block, self._ref[block])
        self._hash[block] = block_hash
        self._by_hash[block_hash] = block

    def record_query(self, num_tokens: int, num_hit_tokens: int) -> None:
        self.stats.queries += num_tokens
        self.stats.hits += num_hit_tokens

    def reset(self) -> bool:
        """vLLM's reset_prefix_cache: forget every cached prefix, only when no block is in use
        (returns False, and changes nothing, while a sequence holds blocks)."""
        if self.num_free != self.num_blocks:
            return False
        self._drop_hashes()
        return True

    def invalidate(self) -> None:
        """The weights changed: forget every cached prefix, including those of blocks in use (they
        are freed as plain blocks later), and start a new epoch."""
        self.epoch += 1
        self._drop_hashes()

    def _drop_hashes(self) -> None:
        for block in self._by_hash.values():
            self._hash[block] = None
        self._by_hash.clear()
        # evictable blocks become free, most recently used on top of the stack
        self._free.extend(self._evictable)
        self._evictable.clear()
