import math
import pickle

import pytest

from asyncgrpo import metrics as M
from asyncgrpo.metrics import MetricRecord, MetricsWindow, metric, rate, ratio, reduction_for

SEED_METRICS = """
num_tokens completions/mean_length completions/min_length completions/max_length
completions/mean_terminated_length completions/min_terminated_length completions/max_terminated_length
completions/clipped_ratio completions/duplicate_frac tools/call_frequency tools/failure_frequency
reward reward_group_std reward_kept reward_dropped frac_reward_zero_std
sampling/sampling_logp_difference/mean sampling/sampling_logp_difference/max
sampling/importance_sampling_ratio/min sampling/importance_sampling_ratio/mean
sampling/importance_sampling_ratio/max sampling/masked_mean sampling/sampler_mass entropy aux_loss
clip_ratio/region_mean clip_ratio/low_mean clip_ratio/low_min clip_ratio/high_mean clip_ratio/high_max
rollout/duration_s rollout/generated_tokens_per_s rollout/concurrency rollout/concurrency_cap
rollout/turns_mean rollout/turns_max rollout/samples_per_rollout rollout/fork_frac
rollout/drift_tokens_mean rollout/drift_tokens_max rollout/score_queue_size rollout/queue_size
rollout/score_s rollout/score_wait_s rollout/score_block_s rollout/backpressure_s rollout/vllm_retry_count
rollout/vllm_kv_cache_usage_frac rollout/vllm_running_requests rollout/vllm_queued_requests
rollout/vllm_preemption_count tools/latency_s tools/unknown_name_count tools/parallel_calls_mean
tools/loop_exhausted_frac env/reset_s env/reward_s sample/forwarded_tokens_mean sample/forwarded_tokens_max
sample/trained_tokens_mean sample/time_in_queue_s sample/staleness_mean sample/staleness_max
sample/dropped_stale_count batch/forwarded_tokens_per_step batch/trained_tokens_per_step
batch/samples_per_step batch/groups_per_step batch/microbatches_per_step batch/masked_token_frac
batch/samples_per_row batch/row_tokens_mean batch/row_tokens_max batch/row_fill_frac batch/row_imbalance
batch/packing_ratio batch/pad_frac batch/dropped_oversize_count perf/step_s perf/fwd_bwd_s perf/fwd_s
perf/optimizer_s perf/rollout_wait_s perf/weight_sync_s perf/weight_sync_pause_s perf/weight_sync_barrier_s
perf/weight_sync_transfer_s perf/fwd_bwd_forwarded_tokens_per_s perf/wall_clock_forwarded_tokens_per_s
perf/wall_clock_trained_tokens_per_s perf/fwd_bwd_mfu perf/wall_clock_mfu
""".split()  # noqa: SIM905


def test_every_seed_metric_has_a_constant():
    constants = {v for k, v in vars(M).items() if k.isupper() and isinstance(v, str)}
    assert set(SEED_METRICS) <= constants
    assert M.reward_mean("accuracy_reward") == "rewards/accuracy_reward/mean"
    assert M.reward_group_std("CounterEnv") == "rewards/CounterEnv/group_std"
    assert M.tool_latency_s("add") == "tools/add/latency_s"
    assert M.tool_call_count("add") == "tools/add/call_count"
    assert M.tool_failure_count("add") == "tools/add/failure_count"


@pytest.mark.parametrize(
    ("name", "rule"),
    [
        (M.SAMPLE_DROPPED_STALE_COUNT, M.SUM),
        (M.tool_call_count("x_max"), M.SUM),
        (M.COMPLETIONS_MAX_LENGTH, M.MAX),
        (M.SAMPLING_IS_RATIO_MIN, M.MIN),
        (M.CLIP_RATIO_LOW_MIN, M.MIN),
        (M.COMPLETIONS_MEAN_TERMINATED_LENGTH, M.MEAN),  # "terminated" contains "min" but is not the word
        (M.COMPLETIONS_MIN_TERMINATED_LENGTH, M.MIN),
        (M.BATCH_SAMPLES_PER_STEP, M.PER_STEP),
        (M.REWARD, M.MEAN),
        (M.SAMPLING_MASKED_MEAN, M.MEAN),
        (M.tool_latency_s("count_words"), M.MEAN),  # only the last path part decides
    ],
)
def test_rule_is_chosen_from_the_last_path_part(name, rule):
    assert reduction_for(name) == rule


def test_means_average_every_item_of_the_window():
    w = MetricsWindow()
    for value in (1.0, 2.0, 6.0):
        w.record(M.REWARD, value)
    w.record(M.ENTROPY, 1.0, weight=3)  # a micro-batch mean over 3 tokens
    w.record(M.ENTROPY, 5.0, weight=1)
    out = w.reduce()
    assert out[M.REWARD] == pytest.approx(3.0)
    assert out[M.ENTROPY] == pytest.approx(2.0)


def test_rates_are_total_tokens_over_total_seconds():
    w = MetricsWindow()
    w.record_rate(M.ROLLOUT_GENERATED_TOKENS_PER_S, 100, 1.0)
    w.record_rate(M.ROLLOUT_GENERATED_TOKENS_PER_S, 900, 9.0)
    w.record_rate(M.PERF_WALL_CLOCK_TRAINED_TOKENS_PER_S, 10, 1.0)
    w.record_rate(M.PERF_WALL_CLOCK_TRAINED_TOKENS_PER_S, 1000, 4.0)
    out = w.reduce()
    assert out[M.ROLLOUT_GENERATED_TOKENS_PER_S] == pytest.approx(100.0)
    assert out[M.PERF_WALL_CLOCK_TRAINED_TOKENS_PER_S] == pytest.approx(1010 / 5)  # not the mean of rates


def test_counts_are_summed_over_the_window_not_since_the_start():
    w = MetricsWindow()
    for _ in range(3):
        w.record(M.SAMPLE_DROPPED_STALE_COUNT, 1)
    w.record(M.SAMPLE_DROPPED_STALE_COUNT, 4)
    assert w.reduce()[M.SAMPLE_DROPPED_STALE_COUNT] == 7
    w.record(M.SAMPLE_DROPPED_STALE_COUNT, 2)
    assert w.reduce()[M.SAMPLE_DROPPED_STALE_COUNT] == 2


def test_max_and_min_keep_the_extremes():
    w = MetricsWindow()
    for value in (3, 9, 1, 4):
        w.record(M.SAMPLE_STALENESS_MAX, value)
        w.record(M.COMPLETIONS_MIN_LENGTH, value)
        w.record(M.COMPLETIONS_MEAN_TERMINATED_LENGTH, value)
    out = w.reduce()
    assert (out[M.SAMPLE_STALENESS_MAX], out[M.COMPLETIONS_MIN_LENGTH]) == (9, 1)
    assert out[M.COMPLETIONS_MEAN_TERMINATED_LENGTH] == pytest.approx(17 / 4)


def test_per_step_amounts_are_averaged_over_the_steps_of_the_window():
    w = MetricsWindow()
    w.record(M.BATCH_FORWARDED_TOKENS_PER_STEP, 100)  # step 1, two micro-batches
    w.record(M.BATCH_FORWARDED_TOKENS_PER_STEP, 50)
    w.end_step()
    w.record(M.BATCH_FORWARDED_TOKENS_PER_STEP, 250)  # step 2, one micro-batch
    w.end_step()
    assert w.reduce()[M.BATCH_FORWARDED_TOKENS_PER_STEP] == pytest.approx(200.0)
    w.record(M.BATCH_SAMPLES_PER_STEP, 4)
    w.record(M.BATCH_SAMPLES_PER_STEP, 6)
    assert w.reduce()[M.BATCH_SAMPLES_PER_STEP] == pytest.approx(5.0)  # no end_step: mean of records


def test_ratio_without_denominator_is_nan_like_tool_failures_without_calls():
    w = MetricsWindow()
    w.record_ratio(M.TOOLS_FAILURE_FREQUENCY, 0, 0)
    assert math.isnan(w.reduce()[M.TOOLS_FAILURE_FREQUENCY])
    w.record_ratio(M.TOOLS_FAILURE_FREQUENCY, 1, 3)
    w.record_ratio(M.TOOLS_FAILURE_FREQUENCY, 0, 1)
    assert w.reduce()[M.TOOLS_FAILURE_FREQUENCY] == pytest.approx(0.25)


def test_nan_values_are_skipped_and_an_all_nan_metric_is_nan():
    w = MetricsWindow()
    w.record(M.REWARD, float("nan"))
    w.record(M.REWARD, 2.0)
    w.record(M.REWARD_DROPPED, float("nan"))
    w.record(M.SAMPLE_STALENESS_MAX, float("nan"))
    out = w.reduce()
    assert (out[M.REWARD] == 2.0 and math.isnan(out[M.REWARD_DROPPED])
            and math.isnan(out[M.SAMPLE_STALENESS_MAX]))


def test_reduce_starts_a_new_window():
    w = MetricsWindow()
    w.record(M.REWARD, 1.0)
    w.end_step()
    w.reduce()
    assert w.reduce() == {}


def test_records_cross_a_queue_as_plain_tuples():
    records = [(M.REWARD, 1.0), metric(M.REWARD, 3.0), rate(M.ROLLOUT_GENERATED_TOKENS_PER_S, 50, 2.0),
               ratio(M.TOOLS_FAILURE_FREQUENCY, 1, 2), metric(M.ENTROPY, 2.0, weight=2)]
    w = MetricsWindow()
    for record in pickle.loads(pickle.dumps(records)):
        w.add(record)
    out = w.reduce()
    assert out == {M.REWARD: 2.0, M.ROLLOUT_GENERATED_TOKENS_PER_S: 25.0, M.TOOLS_FAILURE_FREQUENCY: 0.5,
                   M.ENTROPY: 2.0}
    assert isinstance(records[1], tuple) and isinstance(records[1], MetricRecord)


def test_one_name_cannot_be_both_a_ratio_and_a_value():
    w = MetricsWindow()
    w.record_rate(M.ROLLOUT_GENERATED_TOKENS_PER_S, 1, 1)
    with pytest.raises(ValueError, match="one way only"):
        w.record(M.ROLLOUT_GENERATED_TOKENS_PER_S, 5.0)
