"""Count metrics are summed per window and logged as 0 in a window without events, never missing."""

import math

from asyncgrpo import metrics as M
from asyncgrpo.metrics import MetricsWindow


def test_declared_counts_are_zero_in_a_window_without_events():
    window = MetricsWindow(counts=[M.SAMPLE_DROPPED_STALE_COUNT, M.ROLLOUT_VLLM_RETRY_COUNT])
    window.record(M.REWARD, 0.5)
    assert window.reduce() == {
        M.REWARD: 0.5,
        M.SAMPLE_DROPPED_STALE_COUNT: 0.0,
        M.ROLLOUT_VLLM_RETRY_COUNT: 0.0,
    }
    window.record(M.SAMPLE_DROPPED_STALE_COUNT, 1)
    window.record(M.SAMPLE_DROPPED_STALE_COUNT, 1)
    out = window.reduce()
    assert out[M.SAMPLE_DROPPED_STALE_COUNT] == 2.0 and out[M.ROLLOUT_VLLM_RETRY_COUNT] == 0.0
    assert M.REWARD not in out  # a mean is missing in a window without items, as before


def test_a_count_recorded_once_is_zero_in_every_later_window():
    window = MetricsWindow()
    window.record(M.tool_call_count("lookup"), 1)
    assert window.reduce()[M.tool_call_count("lookup")] == 1.0
    assert window.reduce() == {M.tool_call_count("lookup"): 0.0}
    assert window.reduce() == {M.tool_call_count("lookup"): 0.0}


def test_only_names_whose_last_part_is_a_count_are_filled():
    window = MetricsWindow(counts=[M.BATCH_DROPPED_OVERSIZE_COUNT])
    window.record(M.SAMPLE_STALENESS_MAX, 3)
    window.record(M.PERF_STEP_S, math.nan)
    window.reduce()
    assert window.reduce() == {M.BATCH_DROPPED_OVERSIZE_COUNT: 0.0}


def test_the_seed_count_metrics_are_declared_for_a_trainer():
    names = M.count_metrics(tool_names=["lookup"], has_tools=True, server_has_metrics=True)
    for name in (
        M.SAMPLE_DROPPED_STALE_COUNT,
        M.BATCH_DROPPED_OVERSIZE_COUNT,
        M.ROLLOUT_VLLM_RETRY_COUNT,
        M.ROLLOUT_VLLM_PREEMPTION_COUNT,
        M.TOOLS_UNKNOWN_NAME_COUNT,
        M.OPTIMIZER_NONFINITE_STEP_COUNT,
        M.tool_call_count("lookup"),
        M.tool_failure_count("lookup"),
    ):
        assert name in names
    bare = M.count_metrics(tool_names=[], has_tools=False, server_has_metrics=False)
    assert M.TOOLS_UNKNOWN_NAME_COUNT not in bare  # tools/* only when the trainer has tools
    assert M.ROLLOUT_VLLM_PREEMPTION_COUNT not in bare  # not measured without the server's /metrics
    assert M.SAMPLE_DROPPED_STALE_COUNT in bare
    assert not set(M.HARNESS_COUNTS) & set(bare)  # harness/* only for a HarnessAsyncGRPOTrainer


def test_the_harness_counts_are_declared_for_a_harness_trainer():
    from asyncgrpo.train.harness_trainer import HarnessAsyncGRPOTrainer
    from asyncgrpo.train.trainer import AsyncGRPOTrainer

    names = M.count_metrics(tool_names=[], has_tools=False, server_has_metrics=False, has_harness=True)
    assert set(M.HARNESS_COUNTS) <= set(names)
    assert HarnessAsyncGRPOTrainer.runs_harness and not AsyncGRPOTrainer.runs_harness
    window = MetricsWindow(names)
    assert all(window.reduce()[name] == 0.0 for name in M.HARNESS_COUNTS)


def test_a_reduce_without_filling_leaves_the_counts_out():
    window = MetricsWindow(counts=[M.SAMPLE_DROPPED_STALE_COUNT])
    assert window.reduce(fill_counts=False) == {}
    window.record(M.SAMPLE_DROPPED_STALE_COUNT, 1)
    assert window.reduce(fill_counts=False) == {M.SAMPLE_DROPPED_STALE_COUNT: 1.0}
