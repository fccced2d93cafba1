import pytest

from asyncgrpo.rollout.concurrency import ConcurrencyCap, choose_server, initial_cap


def test_initial_cap_is_requests_fitting_the_kv_cache_clipped():
    assert initial_cap(kv_cache_tokens=100_000, max_model_len=4096, max_concurrent_rollouts=512) == 24
    assert initial_cap(kv_cache_tokens=1_000, max_model_len=4096, max_concurrent_rollouts=512) == 1
    assert initial_cap(kv_cache_tokens=10**9, max_model_len=4096, max_concurrent_rollouts=512) == 512


def test_without_metrics_the_cap_is_fixed_at_the_user_limit():
    cap = ConcurrencyCap(64, kv_cache_tokens=None, max_model_len=None)
    cap.on_rollout_finished(1000)
    assert cap.on_server_load(0.0, 0) == 64 and cap.on_server_load(0.99, 0) == 64


def test_raise_needs_cap_finished_rollouts_low_usage_and_nothing_waiting():
    cap = ConcurrencyCap(512, kv_cache_tokens=8 * 4096, max_model_len=4096)
    assert cap.cap == 8
    cap.on_rollout_finished(7)
    assert cap.on_server_load(0.1, 0) == 8  # fewer than `cap` finished since the last change
    cap.on_rollout_finished(1)
    assert cap.on_server_load(0.1, 3) == 8  # requests waiting
    assert cap.on_server_load(0.7, 0) == 8  # usage between the thresholds
    assert cap.on_server_load(0.1, 0) == 10  # +25 %
    assert cap.on_server_load(0.1, 0) == 10  # at most once per `cap` finished rollouts
    cap.on_rollout_finished(10)
    assert cap.on_server_load(0.59, 0) == 12


def test_cut_by_thirty_percent_above_eighty_percent_usage():
    cap = ConcurrencyCap(512, kv_cache_tokens=100 * 1024, max_model_len=1024)
    assert cap.on_server_load(0.85, 0) == 70
    assert cap.on_server_load(0.8, 0) == 70  # not above 0.8
    assert cap.on_server_load(0.95, 10) == 49
    small = ConcurrencyCap(512, kv_cache_tokens=1024, max_model_len=1024)
    assert small.on_server_load(0.99, 0) == 1


def test_small_caps_still_grow_and_stop_at_the_user_limit():
    cap = ConcurrencyCap(3, kv_cache_tokens=1024, max_model_len=1024)
    for expected in (2, 3, 3):
        cap.on_rollout_finished(cap.cap)
        assert cap.on_server_load(0.0, 0) == expected


def test_invalid_limits():
    with pytest.raises(ValueError, match="max_concurrent_rollouts"):
        ConcurrencyCap(0, None, None)
    with pytest.raises(ValueError, match="max_model_len"):
        initial_cap(100, 0, 4)


# -- the server a new group goes to ------------------------------------------------------------------


def test_a_group_goes_to_the_server_with_the_most_free_capacity():
    assert choose_server([8, 8], [6, 2]) == 1  # 2 free against 6
    assert choose_server([4, 16], [0, 8]) == 1  # 8 free against 4, though it runs more
    assert choose_server([16, 4, 8], [15, 0, 2]) == 2  # 1, 4 and 6 free
    assert choose_server([10], [25]) == 0  # one server takes every group, full or not


def test_a_tie_goes_to_the_lowest_index_so_groups_alternate_between_equal_servers():
    assert choose_server([8, 8, 8], [0, 0, 0]) == 0
    assert choose_server([8, 8, 8], [4, 0, 0]) == 1
    assert choose_server([8, 4], [4, 0]) == 0  # 4 free each
    caps, in_flight, chosen = [8, 8], [0, 0], []
    for _ in range(4):  # groups of 4 rollouts starting one after the other
        index = choose_server(caps, in_flight)
        in_flight[index] += 4
        chosen.append(index)
    assert chosen == [0, 1, 0, 1]


def test_with_every_server_full_the_least_overloaded_one_takes_the_group():
    assert choose_server([4, 4], [8, 6]) == 1  # -4 and -2 free


def test_a_server_without_capacity_is_skipped_even_when_it_runs_nothing():
    assert choose_server([0, 4], [0, 4]) == 1  # both have 0 free: the cap of 0 takes server 0 out
    assert choose_server([4, 0, 2], [3, 0, 0]) == 2
    assert choose_server([0, 0], [0, 0]) is None  # no server to send a group to
