"""Metric names and the logging-window reduction: the single metrics sink.

Components emit records, `(name, value)` or `MetricRecord`s (plain tuples, so the rollout process
can send them through a queue); the trainer feeds them into a `MetricsWindow` and calls `reduce()`
once per logging window (`logging_steps` optimizer steps). Window rules, in order:

    recorded with record_ratio / record_rate   total numerator / total denominator
                                               (rates: total tokens / total seconds; NaN if 0 / 0)
    last path part has the word "count"        summed over the window; 0 in a window without events
                                               (for the names declared up front and any count seen before)
    last path part has the word "max" / "min"  the extreme over the window
    name ends with "_per_step"                 summed, divided by the window's optimizer steps
    anything else                              mean over every recorded item (weighted by `weight`)

"Word" means an `_`-separated token of the last path part: `completions/mean_terminated_length` is a
mean although "terminated" contains "min". NaN values mean "not measured" and are skipped; a metric
that only received NaN reduces to NaN. Units by suffix: `_s` seconds, `tokens_per_s` tokens per
second, `_frac` a fraction in [0, 1], `_per_step` an amount in one optimizer step.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import NamedTuple

# -- training ---------------------------------------------------------------------------------------
NUM_TOKENS = "num_tokens"
COMPLETIONS_MEAN_LENGTH = "completions/mean_length"
COMPLETIONS_MIN_LENGTH = "completions/min_length"
COMPLETIONS_MAX_LENGTH = "completions/max_length"
COMPLETIONS_MEAN_TERMINATED_LENGTH = "completions/mean_terminated_length"
COMPLETIONS_MIN_TERMINATED_LENGTH = "completions/min_terminated_length"
COMPLETIONS_MAX_TERMINATED_LENGTH = "completions/max_terminated_length"
COMPLETIONS_CLIPPED_RATIO = "completions/clipped_ratio"
COMPLETIONS_DUPLICATE_FRAC = "completions/duplicate_frac"
TOOLS_CALL_FREQUENCY = "tools/call_frequency"
TOOLS_FAILURE_FREQUENCY = "tools/failure_frequency"  # record_ratio(failed calls, calls)
REWARD = "reward"
REWARD_GROUP_STD = "reward_group_std"
REWARD_KEPT = "reward_kept"
REWARD_DROPPED = "reward_dropped"
FRAC_REWARD_ZERO_STD = "frac_reward_zero_std"
SAMPLING_LOGP_DIFFERENCE_MEAN = "sampling/sampling_logp_difference/mean"
SAMPLING_LOGP_DIFFERENCE_MAX = "sampling/sampling_logp_difference/max"
SAMPLING_IS_RATIO_MIN = "sampling/importance_sampling_ratio/min"
SAMPLING_IS_RATIO_MEAN = "sampling/importance_sampling_ratio/mean"
SAMPLING_IS_RATIO_MAX = "sampling/importance_sampling_ratio/max"
SAMPLING_MASKED_MEAN = "sampling/masked_mean"
SAMPLING_SAMPLER_MASS = "sampling/sampler_mass"
ENTROPY = "entropy"
AUX_LOSS = "aux_loss"
CLIP_RATIO_REGION_MEAN = "clip_ratio/region_mean"
CLIP_RATIO_LOW_MEAN = "clip_ratio/low_mean"
CLIP_RATIO_LOW_MIN = "clip_ratio/low_min"
CLIP_RATIO_HIGH_MEAN = "clip_ratio/high_mean"
CLIP_RATIO_HIGH_MAX = "clip_ratio/high_max"

# -- rollout ----------------------------------------------------------------------------------------
ROLLOUT_DURATION_S = "rollout/duration_s"
ROLLOUT_GENERATED_TOKENS_PER_S = "rollout/generated_tokens_per_s"  # record_rate(tokens, seconds)
ROLLOUT_CONCURRENCY = "rollout/concurrency"
ROLLOUT_CONCURRENCY_CAP = "rollout/concurrency_cap"
ROLLOUT_TURNS_MEAN = "rollout/turns_mean"
ROLLOUT_TURNS_MAX = "rollout/turns_max"
ROLLOUT_SAMPLES_PER_ROLLOUT = "rollout/samples_per_rollout"
ROLLOUT_FORK_FRAC = "rollout/fork_frac"  # ratio(forks, turn transitions) per rollout
ROLLOUT_DRIFT_TOKENS_MEAN = "rollout/drift_tokens_mean"  # ratio(drift tokens, turn transitions) per rollout
ROLLOUT_DRIFT_TOKENS_MAX = "rollout/drift_tokens_max"
ROLLOUT_SCORE_QUEUE_SIZE = "rollout/score_queue_size"
ROLLOUT_QUEUE_SIZE = "rollout/queue_size"
ROLLOUT_SCORE_S = "rollout/score_s"
ROLLOUT_SCORE_WAIT_S = "rollout/score_wait_s"
ROLLOUT_SCORE_BLOCK_S = "rollout/score_block_s"
ROLLOUT_BACKPRESSURE_S = "rollout/backpressure_s"
ROLLOUT_VLLM_RETRY_COUNT = "rollout/vllm_retry_count"
ROLLOUT_VLLM_KV_CACHE_USAGE_FRAC = "rollout/vllm_kv_cache_usage_frac"
ROLLOUT_VLLM_RUNNING_REQUESTS = "rollout/vllm_running_requests"
ROLLOUT_VLLM_QUEUED_REQUESTS = "rollout/vllm_queued_requests"
ROLLOUT_VLLM_PREEMPTION_COUNT = "rollout/vllm_preemption_count"  # record increments, not totals
# prompt tokens found in the server's prefix cache / prompt tokens looked up, between two polls
ROLLOUT_VLLM_PREFIX_CACHE_HIT_FRAC = "rollout/vllm_prefix_cache_hit_frac"

# -- tools and environments -------------------------------------------------------------------------
TOOLS_LATENCY_S = "tools/latency_s"
TOOLS_UNKNOWN_NAME_COUNT = "tools/unknown_name_count"
TOOLS_PARALLEL_CALLS_MEAN = "tools/parallel_calls_mean"
TOOLS_LOOP_EXHAUSTED_FRAC = "tools/loop_exhausted_frac"
ENV_RESET_S = "env/reset_s"
ENV_REWARD_S = "env/reward_s"

# -- harnesses (HarnessAsyncGRPOTrainer): one 0/1 item per harness run, so a window without a failure logs 0
HARNESS_FAILED_COUNT = "harness/failed_count"  # it raised, returned a bad value or its command failed
HARNESS_TIMEOUT_COUNT = "harness/timeout_count"  # still running after harness_timeout
HARNESS_NO_CALL_COUNT = "harness/no_call_count"  # ended without calling the model
HARNESS_CALLS_MEAN = "harness/calls_mean"  # model calls per harness run
HARNESS_DURATION_S = "harness/duration_s"

# -- samples ----------------------------------------------------------------------------------------
SAMPLE_FORWARDED_TOKENS_MEAN = "sample/forwarded_tokens_mean"
SAMPLE_FORWARDED_TOKENS_MAX = "sample/forwarded_tokens_max"
SAMPLE_TRAINED_TOKENS_MEAN = "sample/trained_tokens_mean"
SAMPLE_TIME_IN_QUEUE_S = "sample/time_in_queue_s"
SAMPLE_STALENESS_MEAN = "sample/staleness_mean"
SAMPLE_STALENESS_MAX = "sample/staleness_max"
SAMPLE_DROPPED_STALE_COUNT = "sample/dropped_stale_count"

# -- batches ----------------------------------------------------------------------------------------
BATCH_FORWARDED_TOKENS_PER_STEP = "batch/forwarded_tokens_per_step"
BATCH_TRAINED_TOKENS_PER_STEP = "batch/trained_tokens_per_step"
BATCH_SAMPLES_PER_STEP = "batch/samples_per_step"
BATCH_GROUPS_PER_STEP = "batch/groups_per_step"
BATCH_MICROBATCHES_PER_STEP = "batch/microbatches_per_step"
BATCH_MASKED_TOKEN_FRAC = "batch/masked_token_frac"
BATCH_SAMPLES_PER_ROW = "batch/samples_per_row"
BATCH_ROW_TOKENS_MEAN = "batch/row_tokens_mean"
BATCH_ROW_TOKENS_MAX = "batch/row_tokens_max"
BATCH_ROW_FILL_FRAC = "batch/row_fill_frac"
BATCH_ROW_IMBALANCE = "batch/row_imbalance"
BATCH_PACKING_RATIO = "batch/packing_ratio"
BATCH_PAD_FRAC = "batch/pad_frac"
BATCH_DROPPED_OVERSIZE_COUNT = "batch/dropped_oversize_count"

# -- performance ------------------------------------------------------------------------------------
PERF_STEP_S = "perf/step_s"
PERF_FWD_BWD_S = "perf/fwd_bwd_s"
PERF_FWD_S = "perf/fwd_s"
PERF_OPTIMIZER_S = "perf/optimizer_s"
PERF_ROLLOUT_WAIT_S = "perf/rollout_wait_s"
PERF_WEIGHT_SYNC_S = "perf/weight_sync_s"
PERF_WEIGHT_SYNC_PAUSE_S = "perf/weight_sync_pause_s"
PERF_WEIGHT_SYNC_BARRIER_S = "perf/weight_sync_barrier_s"
PERF_WEIGHT_SYNC_TRANSFER_S = "perf/weight_sync_transfer_s"
PERF_WEIGHT_SYNC_BYTES = "perf/weight_sync_bytes"  # bytes a push sent
PERF_WEIGHT_SYNC_DELTA_FRAC = "perf/weight_sync_delta_frac"  # pushes sent as a delta (weight_push="delta")
PERF_FWD_BWD_FORWARDED_TOKENS_PER_S = "perf/fwd_bwd_forwarded_tokens_per_s"
PERF_WALL_CLOCK_FORWARDED_TOKENS_PER_S = "perf/wall_clock_forwarded_tokens_per_s"
PERF_WALL_CLOCK_TRAINED_TOKENS_PER_S = "perf/wall_clock_trained_tokens_per_s"
PERF_FWD_BWD_MFU = "perf/fwd_bwd_mfu"
PERF_WALL_CLOCK_MFU = "perf/wall_clock_mfu"

# -- faults -----------------------------------------------------------------------------------------
OPTIMIZER_NONFINITE_STEP_COUNT = "optimizer/nonfinite_step_count"  # steps skipped: inf/NaN loss or gradient


# -- names with a part chosen at run time -----------------------------------------------------------
def reward_mean(reward_name: str) -> str:
    """`rewards/{name}/mean`: a reward function's (or environment class's) mean over trained samples."""
    return f"rewards/{reward_name}/mean"


def reward_group_std(reward_name: str) -> str:
    """`rewards/{name}/group_std`: its within-group std, averaged over trained samples."""
    return f"rewards/{reward_name}/group_std"


def tool_latency_s(tool_name: str) -> str:
    return f"tools/{tool_name}/latency_s"


def tool_call_count(tool_name: str) -> str:
    return f"tools/{tool_name}/call_count"


def tool_failure_count(tool_name: str) -> str:
    return f"tools/{tool_name}/failure_count"


def per_server(name: str, index: int) -> str:
    """`{name}/{index}`: server `index`'s share of a metric (its place in `vllm_server_base_url`), logged
    beside the total when there are several servers. Only a mean is split: with the index as its last
    path part the split reduces as a mean whatever the name's words say, so counts, maxima and minima are
    not split."""
    assert reduction_for(name) == MEAN, f"{name!r} is not reduced as a mean: it has no per-server split"
    return f"{name}/{index}"


HARNESS_COUNTS = (HARNESS_FAILED_COUNT, HARNESS_TIMEOUT_COUNT, HARNESS_NO_CALL_COUNT)


def count_metrics(*, tool_names: Iterable[str], has_tools: bool, server_has_metrics: bool,
                  has_harness: bool = False) -> list[str]:
    """The count metrics a trainer logs in every window, 0 without events: the seed's counts that apply to
    the run (tools/* with tools, the server's preemptions when it serves /metrics) and ours (harness/* for
    a `HarnessAsyncGRPOTrainer`)."""
    names = [SAMPLE_DROPPED_STALE_COUNT, BATCH_DROPPED_OVERSIZE_COUNT, ROLLOUT_VLLM_RETRY_COUNT,
             OPTIMIZER_NONFINITE_STEP_COUNT]
    if has_harness:
        names += HARNESS_COUNTS
    if server_has_metrics:
        names.append(ROLLOUT_VLLM_PREEMPTION_COUNT)
    if has_tools:
        names.append(TOOLS_UNKNOWN_NAME_COUNT)
        for tool in tool_names:
            names += [tool_call_count(tool), tool_failure_count(tool)]
    return names


# -- records ----------------------------------------------------------------------------------------
class MetricRecord(NamedTuple):
    """One measurement. `denominator` set: a ratio/rate term; `weight`: how many items a mean covers."""

    name: str
    value: float
    denominator: float | None = None
    weight: float = 1.0


def metric(name: str, value: float, weight: float = 1.0) -> MetricRecord:
    """A value (one item of a mean, a count increment, a max/min candidate)."""
    return MetricRecord(name, float(value), None, float(weight))


def ratio(name: str, numerator: float, denominator: float) -> MetricRecord:
    """A ratio term: the window reports sum(numerators) / sum(denominators)."""
    return MetricRecord(name, float(numerator), float(denominator))


def rate(name: str, amount: float, seconds: float) -> MetricRecord:
    """A rate term (e.g. tokens over seconds): total amount / total seconds over the window."""
    return ratio(name, amount, seconds)


MEAN, SUM, MAX, MIN, PER_STEP, RATIO = "mean", "sum", "max", "min", "per_step", "ratio"


def reduction_for(name: str) -> str:
    """The window rule that a value recorded under `name` follows (ratios are chosen by the record)."""
    words = name.rsplit("/", 1)[-1].split("_")
    if "count" in words:
        return SUM
    if "max" in words:
        return MAX
    if "min" in words:
        return MIN
    if name.endswith("_per_step"):
        return PER_STEP
    return MEAN


class _Accumulator:
    __slots__ = ("extreme", "kind", "num_values", "total", "weight")

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.total = 0.0  # sum of weighted values (mean, per-step, sum) or numerators (ratio)
        self.weight = 0.0  # sum of weights (mean) or denominators (ratio)
        self.extreme = math.nan
        self.num_values = 0  # non-NaN values seen


class MetricsWindow:
    """Accumulates records over one logging window and reduces them with the window rules.

    `counts`: count metrics reported in every window, 0 when nothing was recorded (a count recorded once
    joins them: tools and environments named only at run time)."""

    def __init__(self, counts: Iterable[str] = ()) -> None:
        self._acc: dict[str, _Accumulator] = {}
        self._num_steps = 0
        self._counts: set[str] = set()
        self.declare_counts(counts)

    def declare_counts(self, names: Iterable[str]) -> None:
        """Report these count metrics in every window from now on, 0 without events."""
        for name in names:
            assert reduction_for(name) == SUM, f"{name!r} is not a count metric"
            self._counts.add(name)

    def _get(self, name: str, kind: str) -> _Accumulator:
        acc = self._acc.get(name)
        if acc is None:
            acc = self._acc[name] = _Accumulator(kind)
        elif (acc.kind == RATIO) != (kind == RATIO):
            raise ValueError(
                f"metric {name!r} was recorded both as a ratio/rate and as a plain value in one window; "
                f"record it one way only"
            )
        return acc

    def record(self, name: str, value: float, weight: float = 1.0) -> None:
        """Record one value; `weight` is the number of items it stands for in a mean."""
        acc = self._get(name, reduction_for(name))
        value = float(value)
        if math.isnan(value):
            return
        acc.num_values += 1
        if acc.kind == MAX:
            acc.extreme = value if math.isnan(acc.extreme) else max(acc.extreme, value)
        elif acc.kind == MIN:
            acc.extreme = value if math.isnan(acc.extreme) else min(acc.extreme, value)
        elif acc.kind == MEAN:
            acc.total += value * weight
            acc.weight += weight
        else:  # SUM, PER_STEP
            acc.total += value
            acc.weight += 1.0

    def record_ratio(self, name: str, numerator: float, denominator: float) -> None:
        """Record a ratio term: the window reports total numerator / total denominator."""
        acc = self._get(name, RATIO)
        numerator, denominator = float(numerator), float(denominator)
        if math.isnan(numerator) or math.isnan(denominator):
            return
        acc.num_values += 1
        acc.total += numerator
        acc.weight += denominator

    def record_rate(self, name: str, amount: float, seconds: float) -> None:
        """Record `amount` (e.g. tokens) produced over `seconds`; reduced as total / total seconds."""
        self.record_ratio(name, amount, seconds)

    def add(self, record: MetricRecord | tuple) -> None:
        """Record a `MetricRecord` or a plain `(name, value)` tuple (what crosses the metrics queue)."""
        rec = MetricRecord(*record)
        if rec.denominator is not None:
            self.record_ratio(rec.name, rec.value, rec.denominator)
        else:
            self.record(rec.name, rec.value, rec.weight)

    def end_step(self) -> None:
        """Mark the end of an optimizer step (the divisor of `_per_step` metrics)."""
        self._num_steps += 1

    def reduce(self, fill_counts: bool = True) -> dict[str, float]:
        """The window's metrics, one float per recorded name; then start a new, empty window.

        A `_per_step` metric recorded in a window with no `end_step()` is the mean of its records. The
        counts known so far and not recorded in the window are 0, unless `fill_counts` is False.
        """
        out: dict[str, float] = {}
        for name, acc in self._acc.items():
            if acc.num_values == 0:
                out[name] = math.nan
            elif acc.kind in (MAX, MIN):
                out[name] = acc.extreme
            elif acc.kind == SUM:
                out[name] = acc.total
            elif acc.kind == PER_STEP:
                out[name] = acc.total / (self._num_steps if self._num_steps else acc.weight)
            else:  # MEAN, RATIO
                out[name] = acc.total / acc.weight if acc.weight else math.nan
            if acc.kind == SUM:
                self._counts.add(name)
        for name in self._counts.difference(out) if fill_counts else ():
            out[name] = 0.0
        self._acc = {}
        self._num_steps = 0
        return out
