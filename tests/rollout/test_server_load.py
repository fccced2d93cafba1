"""The rollout process's servers: the /metrics of several combined into the rollout/vllm_* metrics (pure),
and the bookkeeping that sends each group to the server with the most free capacity (no server needed)."""

import math

import pytest

from asyncgrpo import metrics as M
from asyncgrpo.rollout.server_load import LoadReading, ServerLoads, combined_load


def as_dict(records):
    return dict(records)


def test_one_servers_reading_gives_the_single_server_metrics_unchanged():
    got = as_dict(combined_load([LoadReading(0.25, 3, 1, new_preemptions=2, new_prefix_queries=100,
                                             new_prefix_hits=40)]))
    assert got == {M.ROLLOUT_VLLM_KV_CACHE_USAGE_FRAC: 0.25, M.ROLLOUT_VLLM_RUNNING_REQUESTS: 3,
                   M.ROLLOUT_VLLM_QUEUED_REQUESTS: 1, M.ROLLOUT_VLLM_PREEMPTION_COUNT: 2,
                   M.ROLLOUT_VLLM_PREFIX_CACHE_HIT_FRAC: 0.4}


def test_requests_and_preemptions_add_up_the_kv_usage_is_averaged_the_hit_fraction_pools_lookups():
    got = as_dict(combined_load([
        LoadReading(0.2, 3, 1, new_preemptions=2, new_prefix_queries=100, new_prefix_hits=90),
        LoadReading(0.6, 5, 0, new_preemptions=0, new_prefix_queries=300, new_prefix_hits=30),
    ]))
    assert got[M.ROLLOUT_VLLM_RUNNING_REQUESTS] == 8 and got[M.ROLLOUT_VLLM_QUEUED_REQUESTS] == 1
    assert got[M.ROLLOUT_VLLM_KV_CACHE_USAGE_FRAC] == pytest.approx(0.4)
    assert got[M.ROLLOUT_VLLM_PREEMPTION_COUNT] == 2
    assert got[M.ROLLOUT_VLLM_PREFIX_CACHE_HIT_FRAC] == pytest.approx(120 / 400)  # not (0.9 + 0.1) / 2


def test_what_a_server_does_not_report_is_left_out_and_nothing_reported_is_nan():
    got = as_dict(combined_load([LoadReading(None, None, None), LoadReading(0.5, 2, None)]))
    assert got[M.ROLLOUT_VLLM_KV_CACHE_USAGE_FRAC] == 0.5 and got[M.ROLLOUT_VLLM_RUNNING_REQUESTS] == 2
    assert math.isnan(got[M.ROLLOUT_VLLM_QUEUED_REQUESTS])
    # first polls: no counter increment yet, and a poll without lookups says nothing of the hit fraction
    assert M.ROLLOUT_VLLM_PREEMPTION_COUNT not in got and M.ROLLOUT_VLLM_PREFIX_CACHE_HIT_FRAC not in got
    assert M.ROLLOUT_VLLM_PREFIX_CACHE_HIT_FRAC not in as_dict(
        combined_load([LoadReading(0.1, 0, 0, new_prefix_queries=0, new_prefix_hits=0)]))


def loads(num_servers, max_concurrent_rollouts=8):
    records = []
    servers = ServerLoads([f"http://server-{i}:8000" for i in range(num_servers)], timeout_s=5, api_key=None,
                          max_concurrent_rollouts=max_concurrent_rollouts,
                          record=lambda name, value: records.append((name, value)))
    return servers, records


def test_groups_spread_over_the_servers_and_a_finished_rollout_frees_its_servers_slot():
    servers, _ = loads(2)
    assert [servers.start_group(4) for _ in range(3)] == [0, 1, 0]
    assert [load.in_flight for load in servers.loads] == [8, 4]
    for _ in range(4):
        servers.on_rollout_finished(0)
    assert [load.in_flight for load in servers.loads] == [4, 4]
    assert servers.start_group(4) == 0  # a tie: the lowest index


def test_the_total_cap_is_the_servers_caps_within_max_concurrent_rollouts():
    servers, _ = loads(3, max_concurrent_rollouts=8)
    assert servers.cap() == 8  # unconnected servers: max_concurrent_rollouts each, 24 in all, clipped


def test_the_per_server_split_is_logged_only_with_several_servers():
    one, records = loads(1)
    one.start_group(4)
    one.record_concurrency(4)
    assert {name for name, _ in records} == {M.ROLLOUT_CONCURRENCY, M.ROLLOUT_CONCURRENCY_CAP}
    two, records = loads(2)
    two.start_group(4)
    two.record_concurrency(4)
    assert dict(records) == {M.ROLLOUT_CONCURRENCY: 4, M.ROLLOUT_CONCURRENCY_CAP: 8,
                             "rollout/concurrency/0": 4, "rollout/concurrency/1": 0,
                             "rollout/concurrency_cap/0": 8, "rollout/concurrency_cap/1": 8}


def test_a_per_server_name_keeps_the_totals_window_rule():
    assert M.per_server(M.PERF_WEIGHT_SYNC_S, 1) == "perf/weight_sync_s/1"
    assert M.reduction_for(M.per_server(M.ROLLOUT_CONCURRENCY, 0)) == M.MEAN
    with pytest.raises(AssertionError):
        M.per_server(M.ROLLOUT_VLLM_PREEMPTION_COUNT, 0)  # a count split as ".../0" would be averaged


def test_a_request_whose_server_is_gone_moves_to_another_server_which_counts_its_rollout(caplog):
    servers, _ = loads(3)
    assert [servers.start_group(4) for _ in range(2)] == [0, 1]
    gone = ConnectionError("POST http://server-0:8000/inference/v1/generate failed: connection refused. "
                           "The rest")
    with caplog.at_level("WARNING", logger="asyncgrpo.rollout.server_load"):
        assert servers.fail_over(0, gone) == 2  # the most free capacity among the others
        assert servers.fail_over(0, gone) == 2
    assert [load.in_flight for load in servers.loads] == [2, 4, 2]
    assert caplog.text.count("the inference server at http://server-0:8000 does not answer") == 1  # once
    assert "connection refused)" in caplog.text and "The rest" not in caplog.text
    assert servers.loads[0].cap() == 0 and servers.cap() == 8  # out of the cap and of the choice
    assert [servers.start_group(4) for _ in range(2)] == [2, 1]


def test_with_no_other_server_left_the_request_does_not_move():
    one, _ = loads(1)
    one.start_group(4)
    assert one.fail_over(0, ConnectionError("gone")) is None and not one.loads[0].out
    two, _ = loads(2)
    two.fail_over(1, ConnectionError("gone"))
    assert two.fail_over(0, ConnectionError("gone")) is None and not two.loads[0].out  # the last one stays in
