"""Finding decode sequences that share their first KV blocks (server/attention/shared_prefix.py), against a
brute-force reading of the block tables."""

from __future__ import annotations

import numpy as np
import pytest

from asyncgrpo.server.attention.shared_prefix import SharedPrefixes, find_shared_prefixes, max_members

BS = 4
NULL = 10_000


def _tables(rows: list[list[int]]) -> np.ndarray:
    width = max(map(len, rows))
    # entries past a sequence's blocks hold stale ids, as the scheduler's rows do
    return np.array([r + [7777 + i] * (width - len(r)) for i, r in enumerate(rows)], dtype=np.int64)


def _entries(sp) -> list[tuple[int, list[int]]]:
    """(shared tokens, members in ascending order) of each group entry."""
    return sorted((e[0], sorted(m for m in e[1:] if m >= 0)) for e in sp.groups.tolist())


def _common_blocks(tables: np.ndarray, lens: np.ndarray, members: list[int]) -> int:
    """Leading blocks equal in every member's table and wholly before each member's new token."""
    n = 0
    while all(n < (lens[m] - 1) // BS for m in members) and len({tables[m, n] for m in members}) == 1:
        if tables[members[0], n] == NULL:
            break
        n += 1
    return n


def test_a_group_shares_its_prompt_blocks_and_reads_its_own_tail_alone():
    prompt = [0, 1, 2, 3, 4]  # 5 full blocks = 20 tokens
    rows = [prompt + [10 + i, 20 + i] for i in range(3)] + [[30, 31, 32, 33, 34, 35]]
    lens = np.array([27, 25, 28, 22])
    sp = find_shared_prefixes(_tables(rows), lens, BS, members=4, null_block=NULL, min_blocks=2)
    assert sp.lens.tolist() == [20, 20, 20, 0]
    assert _entries(sp) == [(20, [0, 1, 2])]


def test_large_groups_are_split_into_entries_and_a_lone_remainder_reads_alone():
    prompt = [0, 1, 2, 3]
    rows = [prompt + [10 + i] for i in range(5)]
    lens = np.full(5, 19)
    sp = find_shared_prefixes(_tables(rows), lens, BS, members=2, null_block=NULL, min_blocks=2)
    assert [n for n, _ in _entries(sp)] == [16, 16]
    assert sorted(i for _, ids in _entries(sp) for i in ids) == [i for i in range(5) if sp.lens[i]]
    assert sorted(sp.lens.tolist()) == [0, 16, 16, 16, 16]


def test_a_block_holding_the_new_token_is_never_shared():
    # both hold blocks 0..2; the new token of the first sits in block 2 (context 9 -> position 8)
    rows = [[0, 1, 2], [0, 1, 2, 3]]
    sp = find_shared_prefixes(_tables(rows), np.array([9, 14]), BS, members=4, null_block=NULL, min_blocks=1)
    assert _entries(sp) == [(8, [0, 1])]


def test_released_blocks_and_short_prefixes_are_not_shared():
    rows = [[NULL, NULL, 5, 6, 7], [NULL, NULL, 5, 6, 8]]
    assert find_shared_prefixes(_tables(rows), np.array([20, 20]), BS, 4, NULL, min_blocks=1) is None
    rows = [[0, 1, 2, 9], [0, 1, 3, 8]]  # two common blocks, fewer than min_blocks
    assert find_shared_prefixes(_tables(rows), np.array([16, 16]), BS, 4, NULL, min_blocks=3) is None
    assert find_shared_prefixes(_tables(rows), np.array([16, 16]), BS, 4, NULL,
                                min_blocks=2).lens.tolist() == [8, 8]


def test_groups_behind_a_common_system_prompt_keep_their_own_prompts():
    """Every GRPO prompt starts with the same system prompt (block 0): groups still share their prompts."""
    rows = [[0, 1 + 10 * g, 2 + 10 * g, 3 + 10 * g, 4 + 10 * g, 100 + 8 * g + i]
            for g in range(3) for i in range(4)]
    rows.append(list(range(500, 540)))  # and a long conversation of its own
    lens = np.r_[np.full(12, 23), 40 * BS]
    sp = find_shared_prefixes(_tables(rows), lens, BS, members=8, null_block=NULL, min_blocks=1)
    assert _entries(sp) == [(20, [0, 1, 2, 3]), (20, [4, 5, 6, 7]), (20, [8, 9, 10, 11])]


@pytest.mark.parametrize("seed", range(20))
def test_random_prefix_trees_match_a_brute_force_reading(seed):
    """Sequences branch off shared prompts at random depths (multi-turn histories, groups); every entry
    shares exactly the blocks common to its members, and no sequence is in two entries."""
    rng = np.random.default_rng(seed)
    next_id = 0

    def fresh(n):
        nonlocal next_id
        next_id += n
        return list(range(next_id - n, next_id))

    rows = []
    for _ in range(rng.integers(1, 6)):
        trunk = fresh(int(rng.integers(1, 12)))
        for _ in range(rng.integers(1, 7)):
            cut = int(rng.integers(0, len(trunk) + 1))
            rows.append(trunk[:cut] + fresh(int(rng.integers(1, 4))))
    order = rng.permutation(len(rows))
    rows = [rows[i] for i in order]
    lens = np.array([len(r) * BS - int(rng.integers(0, BS)) for r in rows])
    tables = _tables(rows)
    members = int(rng.integers(2, 5))
    sp = find_shared_prefixes(tables, lens, BS, members, NULL, min_blocks=2)
    if sp is None:
        return
    seen = set()
    for entry in sp.groups.tolist():
        ids = [m for m in entry[1:] if m >= 0]
        assert 2 <= len(ids) <= members and not seen & set(ids)
        seen |= set(ids)
        assert entry[0] % BS == 0 and entry[0] // BS >= 2
        assert entry[0] // BS <= _common_blocks(tables, lens, ids)
        assert all(sp.lens[m] == entry[0] for m in ids)
    assert all(sp.lens[i] == 0 for i in range(len(rows)) if i not in seen)


def test_members_per_entry_fill_one_tile_of_query_rows():
    assert max_members(16, 8) == 16  # 2 query heads per kv head
    assert max_members(32, 8) == 8
    assert max_members(64, 2) == 0  # 32 heads per kv head: one member per tile, nothing to share


def test_groups_of_two_parts_of_a_batch_concatenate_with_the_second_parts_rows_offset():
    first = SharedPrefixes(np.array([32, 32, 0]), np.array([[32, 0, 1, -1]]))
    second = SharedPrefixes(np.array([0, 16, 16, 16]), np.array([[16, 1, 2, 3]]))
    both = SharedPrefixes.concat(first, 3, second, 4)
    assert both.lens.tolist() == [32, 32, 0, 0, 16, 16, 16]
    assert both.groups.tolist() == [[32, 0, 1, -1], [16, 4, 5, 6]]
    only_second = SharedPrefixes.concat(None, 2, second, 4)
    assert (only_second.lens.tolist() == [0, 0, 0, 16, 16, 16]
            and only_second.groups.tolist() == [[16, 3, 4, 5]])
    assert SharedPrefixes.concat(first, 3, None, 5).lens.tolist() == [32, 32, 0, 0, 0, 0, 0, 0]
    assert SharedPrefixes.concat(None, 3, None, 5) is None
