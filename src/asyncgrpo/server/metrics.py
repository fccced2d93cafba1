"""Prometheus metrics of the embedded server, with vLLM 0.33's names and labels.

Series (labels `model_name` = served name, `engine` = "0"):
    vllm:num_requests_running, vllm:num_requests_waiting   gauges (sequences, like vLLM)
    vllm:kv_cache_usage_perc                                gauge, a fraction 0..1
    vllm:num_preemptions_total                              counter (declared vllm:num_preemptions)
    vllm:prompt_tokens_total, vllm:generation_tokens_total  counters
    vllm:prefix_cache_queries_total                         counter: prompt tokens looked up in the
                                                            prefix cache
    vllm:prefix_cache_hits_total                            counter: of those, tokens found cached
    vllm:rl_weight_update_operation_duration_seconds        histogram, label `operation`
    vllm:rl_weight_update_operations_in_flight              gauge, label `operation`
    asyncgrpo:max_num_seqs_per_step                         gauge: most sequences in one forward
Gauges refresh when the engine steps or changes state (stale while paused, as in vLLM).
"""

from __future__ import annotations

import collections
import time
from contextlib import contextmanager
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

__all__ = ["CONTENT_TYPE_LATEST", "RECENT_STEPS", "EngineStats", "ServerMetrics", "StepRecord"]


class ServerMetrics:
    """One registry per server (no process-global state)."""

    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        labels = ["model_name", "engine"]
        values = {"model_name": model_name, "engine": "0"}
        reg = self.registry
        self.running = Gauge(
            "vllm:num_requests_running", "Number of requests in model execution batches.", labels,
            registry=reg,
        ).labels(**values)
        self.waiting = Gauge(
            "vllm:num_requests_waiting", "Number of requests waiting to be processed.", labels, registry=reg
        ).labels(**values)
        self.kv_usage = Gauge(
            "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", labels, registry=reg
        ).labels(**values)
        self.preemptions = Counter(
            "vllm:num_preemptions", "Cumulative number of preemption from the engine.", labels, registry=reg
        ).labels(**values)
        self.prompt_tokens = Counter(
            "vllm:prompt_tokens", "Number of prefill tokens processed.", labels, registry=reg
        ).labels(**values)
        self.generation_tokens = Counter(
            "vllm:generation_tokens", "Number of generation tokens processed.", labels, registry=reg
        ).labels(**values)
        self.prefix_queries = Counter(
            "vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.",
            labels, registry=reg,
        ).labels(**values)
        self.prefix_hits = Counter(
            "vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.", labels,
            registry=reg,
        ).labels(**values)
        self.max_batch = Gauge(
            "asyncgrpo:max_num_seqs_per_step",
            "Most sequences served by one forward pass since start.",
            labels,
            registry=reg,
        ).labels(**values)
        op_labels = labels + ["operation"]
        self._op_duration = Histogram(
            "vllm:rl_weight_update_operation_duration_seconds",
            "Duration of weight-update operations.",
            op_labels,
            registry=reg,
        )
        self._op_in_flight = Gauge(
            "vllm:rl_weight_update_operations_in_flight",
            "Weight-update operations in flight.",
            op_labels,
            registry=reg,
        )
        self._values = values
        self._seen = {"preemptions": 0, "prompt": 0, "generation": 0, "queries": 0, "hits": 0}

    def update(self, num_running: int, num_waiting: int, kv_usage: float, stats, prefix_stats) -> None:
        """Refresh from the engine (called by the engine thread after each step/state change);
        `stats` are the engine's counters, `prefix_stats` the block pool's (`PrefixCacheStats`)."""
        self.running.set(num_running)
        self.waiting.set(num_waiting)
        self.kv_usage.set(kv_usage)
        self.max_batch.set(stats.max_batch_seqs)
        for key, counter, total in (
            ("preemptions", self.preemptions, stats.num_preemptions),
            ("prompt", self.prompt_tokens, stats.prompt_tokens),
            ("generation", self.generation_tokens, stats.generation_tokens),
            ("queries", self.prefix_queries, prefix_stats.queries),
            ("hits", self.prefix_hits, prefix_stats.hits),
        ):
            if total > self._seen[key]:
                counter.inc(total - self._seen[key])
                self._seen[key] = total

    @contextmanager
    def operation(self, name: str):
        """Time a weight-transfer operation (init, start, update, finish, shutdown)."""
        gauge = self._op_in_flight.labels(operation=name, **self._values)
        gauge.inc()
        start = time.perf_counter()
        try:
            yield
        finally:
            gauge.dec()
            self._op_duration.labels(operation=name, **self._values).observe(time.perf_counter() - start)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class EngineStats:
    """Counters read by /metrics and /server_info (written by the engine thread)."""

    def __init__(self) -> None:
        self.num_steps = 0
        self.num_prefill_steps = 0  # steps with prompt chunks (eager forwards unless their chunks are short)
        self.step_s = 0.0  # engine-thread seconds inside steps (the rest of its time it waits for work)
        # ... split: planning (scheduler), the model runner's step (forward, sampling, the device->host
        # copy that waits for the device), recording the tokens and handing them to the HTTP side
        self.schedule_s = 0.0
        self.forward_s = 0.0
        self.record_s = 0.0
        self.max_batch_seqs = 0
        self.num_preemptions = 0
        self.prompt_tokens = 0
        self.generation_tokens = 0
        # the last steps, one StepRecord each (for finding which steps are slow: /server_info?steps=N)
        self.recent: collections.deque[StepRecord] = collections.deque(maxlen=RECENT_STEPS)


RECENT_STEPS = 4096  # steps EngineStats keeps one by one


@dataclass(slots=True)
class StepRecord:
    """One step as the engine thread saw it (milliseconds; `record_ms` is that of the step recorded
    after this one was launched: its predecessor with asynchronous scheduling, itself without)."""

    start: float  # time.perf_counter() at the step's start
    decode: int  # sequences decoding one token
    prefill_tokens: int  # prompt tokens computed
    kv_tokens: int  # context tokens the decode rows attend over (shared prefixes counted once)
    schedule_ms: float
    forward_ms: float  # launching the step (eager kernels or a graph replay; a capture when one ran)
    record_ms: float
    wait_ms: float  # of record_ms, waiting for the device's output
    captured: bool  # a CUDA graph was captured in this step
