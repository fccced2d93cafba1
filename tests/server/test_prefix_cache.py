"""Block hashing, reference counts and LRU eviction of the prefix-caching block pool."""

from __future__ import annotations

from types import SimpleNamespace

from asyncgrpo.server.prefix_cache import (
    BlockPool,
    extend_block_hashes,
    hash_block,
    prefix_caching_enabled,
    unsupported_layer_types,
)


def _hashes(tokens, bs=4):
    return extend_block_hashes([], tokens, bs, len(tokens) // bs)


def test_block_hash_names_the_whole_prefix_not_only_the_block():
    a = _hashes([1, 2, 3, 4, 5, 6, 7, 8])
    b = _hashes([9, 2, 3, 4, 5, 6, 7, 8])
    assert len(a) == 2 and a[1] != b[1]  # same second block, different first block
    assert a == _hashes([1, 2, 3, 4, 5, 6, 7, 8, 9, 10])  # a partial last block has no hash
    assert hash_block(a[0], [5, 6, 7, 8]) == a[1]


def test_extend_block_hashes_continues_where_it_stopped():
    tokens = list(range(20))
    hashes = extend_block_hashes([], tokens[:8], 4, 2)
    assert extend_block_hashes(hashes, tokens, 4, 5) == _hashes(tokens) and len(hashes) == 5


def test_allocate_and_free_round_trip_without_caching():
    pool = BlockPool(5, enable_caching=False)
    a, b = pool.allocate(2), pool.allocate(3)
    assert sorted(a + b) == [0, 1, 2, 3, 4] and pool.num_free == 0
    pool.free(a)
    assert pool.num_free == 2 and sorted(pool.allocate(2)) == sorted(a)
    assert pool.allocate(0) == []
    pool.register(b[0], b"x" * 16)
    assert pool.match([b"x" * 16]) == [] and pool.num_cached == 0


def test_shared_blocks_are_counted_and_survive_their_first_owner():
    pool = BlockPool(4)
    blocks = pool.allocate(2)
    hashes = _hashes(list(range(8)))
    for b, h in zip(blocks, hashes):
        pool.register(b, h)
    hit = pool.match(hashes + [b"unknown"])
    assert hit == blocks and pool.num_evictable(hit) == 0
    pool.touch(hit)  # a second sequence shares both blocks
    pool.free(blocks)  # the first one ends
    assert pool.num_free == 2 and pool.match(hashes) == blocks  # still held by the second
    pool.free(hit)
    assert pool.num_free == 4 and pool.num_evictable(hit) == 2  # cached, evictable
    pool.touch(pool.match(hashes))
    assert pool.num_free == 2


def test_free_blocks_go_first_then_least_recently_released_cached_blocks_tail_first():
    pool = BlockPool(6)
    first, second = pool.allocate(2), pool.allocate(2)
    h1, h2 = _hashes([1] * 8), _hashes([2] * 8)
    for blocks, hashes in ((first, h1), (second, h2)):
        for b, h in zip(blocks, hashes):
            pool.register(b, h)
    pool.free(first)
    pool.free(second)
    plain = pool.allocate(2)  # the two never-used blocks
    assert set(plain).isdisjoint(first + second)
    assert pool.match(h1) == first and pool.match(h2) == second
    assert pool.allocate(1) == [first[1]]  # LRU: first released first, its tail before its head
    assert pool.match(h1) == [first[0]]
    assert pool.allocate(1) == [first[0]] and pool.match(h1) == []
    assert pool.match(h2) == second


def test_a_hash_already_cached_stays_with_its_first_block():
    pool = BlockPool(3)
    a, b = pool.allocate(1), pool.allocate(1)
    h = _hashes([7] * 4)[0]
    pool.register(a[0], h)
    pool.register(b[0], h)  # same content computed twice (e.g. two greedy continuations)
    pool.free(b)
    assert pool.match([h]) == a and pool.num_cached == 1
    assert pool.allocate(2) == [b[0], 2]  # b went back as a plain free block, taken before any eviction
    assert pool.match([h]) == a


def test_reset_only_without_blocks_in_use_and_invalidate_always():
    pool = BlockPool(3)
    blocks = pool.allocate(2)
    hashes = _hashes(list(range(8)))
    for b, h in zip(blocks, hashes):
        pool.register(b, h)
    assert not pool.reset() and pool.match(hashes) == blocks  # vLLM: fails while blocks are held
    pool.free(blocks)
    assert pool.reset() and pool.match(hashes) == [] and pool.num_free == 3
    blocks = pool.allocate(2)
    for b, h in zip(blocks, hashes):
        pool.register(b, h)
    epoch = pool.epoch
    pool.invalidate()  # a weight update: even blocks in use are forgotten
    assert pool.epoch == epoch + 1 and pool.match(hashes) == []
    pool.free(blocks)
    assert pool.num_free == 3 and pool.num_cached == 0


def test_query_and_hit_counters_are_in_tokens():
    pool = BlockPool(2)
    pool.record_query(40, 32)
    pool.record_query(10, 0)
    assert (pool.stats.queries, pool.stats.hits) == (50, 32)


def test_models_with_recurrent_layers_are_served_uncached():
    hybrid = SimpleNamespace(layer_types=["linear_attention", "full_attention"])
    assert unsupported_layer_types(hybrid) == ["linear_attention"]
    assert not prefix_caching_enabled(True, hybrid)
    assert unsupported_layer_types(SimpleNamespace(layer_types=["sliding_attention", "full_attention"])) == []
    assert prefix_caching_enabled(True, SimpleNamespace())
    assert not prefix_caching_enabled(False, SimpleNamespace())


def test_a_sliding_window_hit_needs_only_the_blocks_its_window_reaches():
    pool = BlockPool(8)
    hashes = _hashes(list(range(24)))  # 6 blocks
    blocks = pool.allocate(6)
    for b, h in zip(blocks, hashes):
        pool.register(b, h)
    pool.free(blocks[:3][::-1])  # released head first, as a window moves on: evicted first
    pool.free(blocks[3:])
    assert pool.allocate(4) == [6, 7, blocks[0], blocks[1]]  # two free blocks, then the two oldest cached
    assert pool.match(hashes) == []  # the prefix from token 0 is gone
    assert pool.match_tail(hashes, 2) == (6, blocks[4:])  # its last two blocks are all a window reads
    assert pool.match_tail(hashes[:4], 2) == (4, blocks[2:4])
    assert pool.match_tail(hashes, 5) == (0, [])  # five blocks in a row are not cached any more
    pool.allocate(1)  # evicts blocks[2]: the run 3..5 is left
    assert pool.match_tail(hashes[:4], 2) == (0, [])
    assert pool.match_tail(hashes, 3) == (6, blocks[3:])
    assert pool.match_tail(_hashes(list(range(100, 112))), 2) == (0, [])  # another prompt
    # a run from block 0 shorter than the tail is a hit too (the window reaches the first token)
    other = BlockPool(4)
    first = other.allocate(1)
    other.register(first[0], hashes[0])
    assert other.match_tail(hashes, 3) == (1, first)
    assert BlockPool(4, enable_caching=False).match_tail(hashes, 2) == (0, [])
