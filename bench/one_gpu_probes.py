"""What bench/one_gpu.py measures beside the trainer's own metrics, and the arithmetic over a run.

    RoundTrip          a thread sending a one-token completion every half second and timing the answer:
                       how far behind the server's HTTP side runs (a control call such as /pause
                       waits in the same line)
    GpuMemory          a thread sampling, once a second, nvidia-smi's used memory per process and the
                       device's used memory (torch.cuda.mem_get_info); peaks per pid
    rollout_cpu_s()    CPU seconds (user + system) of the rollout process (the trainer's spawned child)
    generated_tokens() the server's vllm:generation_tokens_total (the embedded server and vLLM both count it)
    CounterPoller      a thread reading such a counter every half second, so that the trainer never waits
                       on the server's HTTP side; `value_at(t)` interpolates between its readings
    wait_until_idle()  until the server runs no request (between runs)
    server_cache_config()  the server's KV cache size and scheduler settings (/server_info)
    embedded_graph_counts()  the embedded server's CUDA-graph captures, and those deferred (/server_info)
    RunRecorder        a TrainerCallback: per logged step the time, the step's metrics and the two
                       counters above (the generated tokens filled in from the poller after the run);
                       stops training at the first step end `max_seconds` after the
                       warm-up steps (so both settings are measured over windows of the same length)
    steady_summary()   pure: the rates over the steps after the warm-up (see its docstring)

Nothing here changes what the trainer does; the callback only reads and, past the time limit, asks
the Trainer to stop after the current step.
"""

from __future__ import annotations

import itertools
import json
import math
import multiprocessing
import os
import shutil
import statistics
import subprocess
import threading
import time
import urllib.request
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from transformers import TrainerCallback

from asyncgrpo.generation.server_info import parse_metrics

if TYPE_CHECKING:
    from typing_extensions import Self

STEP_KEYS_KEPT = (  # per-step values kept in the JSON besides every perf/* (the summary has all means)
    "batch/trained_tokens_per_step", "batch/samples_per_step", "sample/staleness_mean",
    "sample/dropped_stale_count", "reward", "reward_group_std", "frac_reward_zero_std",
    "completions/mean_length", "rollout/backpressure_s", "rollout/concurrency", "rollout/concurrency_cap",
    "rollout/vllm_kv_cache_usage_frac", "sampling/importance_sampling_ratio/mean",
)
TOTAL_KEYS = ("batch/trained_tokens_per_step", "batch/samples_per_step")  # mean and total over the window
COUNT_KEYS = ("sample/dropped_stale_count",)  # logged only by the steps that count some: total only


def generated_tokens(base_url: str, api_key: str | None = None) -> float | None:
    """The server's generated-token counter, or None when /metrics does not answer."""
    request = urllib.request.Request(f"{base_url}/metrics",
                                     headers={"Authorization": f"Bearer {api_key}"} if api_key else {})
    try:
        with urllib.request.urlopen(request, timeout=5) as response:
            return parse_metrics(response.read().decode()).generation_tokens
    except OSError:
        return None


def _server_info(base_url: str) -> dict[str, Any] | None:
    """The server's /server_info (None without the route)."""
    try:
        with urllib.request.urlopen(f"{base_url}/server_info?config_format=json", timeout=10) as response:
            return json.loads(response.read().decode())
    except (OSError, ValueError):
        return None


def server_cache_config(base_url: str) -> dict[str, Any] | None:
    """The server's KV-cache and scheduler settings from /server_info (None without the route)."""
    info = _server_info(base_url)
    if info is None:
        return None
    config = info.get("vllm_config") or {}
    return {"cache_config": config.get("cache_config"), "scheduler_config": config.get("scheduler_config"),
            "device_config": config.get("device_config")}


def embedded_graph_counts(base_url: str) -> dict[str, Any] | None:
    """The embedded server's CUDA-graph counters from /server_info (captures, their seconds, and steps of a
    new shape run eagerly while a trainer in its process computed); None for another server."""
    embedded = (_server_info(base_url) or {}).get("embedded")
    if not embedded:
        return None
    return {
        k: embedded.get(k) for k in ("graph_captures", "graph_capture_seconds", "graph_captures_deferred")
    }


def wait_until_idle(base_url: str, timeout_s: float = 60.0) -> float:
    """Seconds until the server runs and queues no request (what a stopped run left is aborted or done),
    at most `timeout_s`; the next run then starts on an idle server."""
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < timeout_s:
        try:
            with urllib.request.urlopen(f"{base_url}/metrics", timeout=5) as response:
                m = parse_metrics(response.read().decode())
        except OSError:
            break
        if not (m.num_requests_running or m.num_requests_waiting):
            break
        time.sleep(0.5)
    return time.perf_counter() - t0


def rollout_cpu_s() -> float | None:
    """CPU seconds (user + system, all threads) of the rollout process this process spawned (found by its
    multiprocessing name); None without psutil or without a rollout process."""
    try:
        import psutil
    except ImportError:
        return None
    from asyncgrpo.rollout.channel import ROLLOUT_PROCESS_NAME

    total = None
    for child in multiprocessing.active_children():
        if child.name != ROLLOUT_PROCESS_NAME or child.pid is None:
            continue
        try:
            times = psutil.Process(child.pid).cpu_times()
        except psutil.Error:  # it ended between the listing and the reading
            continue
        total = (total or 0.0) + times.user + times.system
    return total


def interpolate(samples: list[tuple[float, float]], t: float) -> float | None:
    """The value at time t from (time, value) samples in time order: linear between the two around t,
    the nearest one outside them, None without samples."""
    if not samples:
        return None
    if t <= samples[0][0]:
        return samples[0][1]
    for (t0, v0), (t1, v1) in itertools.pairwise(samples):
        if t <= t1:
            return v0 + (v1 - v0) * ((t - t0) / (t1 - t0) if t1 > t0 else 1.0)
    return samples[-1][1]


class _Sampler:
    """A daemon thread that calls `sample()` at once and then every `interval_s` for as long as the
    `with` block runs."""

    thread_name = "sampler"

    def __init__(self, interval_s: float) -> None:
        self.interval_s = interval_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def sample(self) -> None:
        raise NotImplementedError

    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _run(self) -> None:
        while True:
            self.sample()
            if self._stop.wait(self.interval_s):
                return

    def __enter__(self) -> Self:
        self._thread = threading.Thread(target=self._run, name=self.thread_name, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=15)


class CounterPoller(_Sampler):
    """Reads a counter (`read() -> float | None`) in a thread every `interval_s` and keeps the readings,
    each stamped with the middle of its read (time.perf_counter). A read of a busy server's /metrics
    can take seconds; made between two training steps it would stall the trainer, so the recorder
    takes the value from here instead. `read_s` lists how long each read took."""

    thread_name = "counter-poller"

    def __init__(self, read: Callable[[], float | None], interval_s: float = 0.5) -> None:
        super().__init__(interval_s)
        self.read = read
        self.samples: list[tuple[float, float]] = []
        self.read_s: list[float] = []

    def sample(self) -> None:
        t0 = time.perf_counter()
        value = self.read()
        t1 = time.perf_counter()
        self.read_s.append(t1 - t0)
        if value is not None:
            self.samples.append(((t0 + t1) / 2, value))

    def latest(self) -> float | None:
        return self.samples[-1][1] if self.samples else None

    def value_at(self, t: float, wait_s: float = 15.0) -> float | None:
        """The counter at time t, waiting up to `wait_s` for a reading after t (the last steps' readings
        come up to one interval and one read later)."""
        deadline = time.perf_counter() + wait_s
        while (
            (not self.samples or self.samples[-1][0] < t)
            and self.running()
            and time.perf_counter() < deadline
        ):
            time.sleep(0.05)
        return interpolate(list(self.samples), t)


def served_model(base_url: str) -> str | None:
    """The first model id of the server's /v1/models (None when it does not answer)."""
    try:
        with urllib.request.urlopen(f"{base_url}/v1/models", timeout=10) as response:
            return json.loads(response.read().decode())["data"][0]["id"]
    except (OSError, ValueError, KeyError, IndexError):
        return None


class RoundTrip(_Sampler):
    """Every `interval_s` a one-token completion of a three-token prompt (`/v1/completions`) and the
    seconds until its answer. With the engine stepping every few tens of milliseconds, a late answer
    means the server's HTTP side runs behind: vLLM's API server processes every step's outputs, and the
    answers of control calls (/pause), in order. While a weight sync pauses the server the probe waits
    for the resume too. Its two tokens a second go into the server's token counter."""

    thread_name = "round-trip"

    def __init__(
        self, base_url: str, model: str | None, interval_s: float = 0.5, timeout_s: float = 60.0
    ) -> None:
        super().__init__(interval_s)
        self.url = f"{base_url}/v1/completions"
        self.body = json.dumps(
            {"model": model, "prompt": [1, 2, 3], "max_tokens": 1, "temperature": 1.0}
        ).encode()
        self.timeout_s = timeout_s
        self.samples: list[tuple[float, float]] = []  # (sent at, time.perf_counter; seconds to the answer)
        self.failures = 0

    def sample(self) -> None:
        request = urllib.request.Request(
            self.url, data=self.body, headers={"Content-Type": "application/json"}
        )
        t0 = time.perf_counter()
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                response.read()
        except OSError:
            self.failures += 1
            return
        self.samples.append((t0, time.perf_counter() - t0))

    def report(self, since: float = 0.0) -> dict[str, Any] | None:
        """Quantiles of the answers' seconds, and every (seconds after `since`, seconds) pair."""
        seconds = sorted(s for _, s in self.samples)
        if not seconds:
            return {"probes": 0, "failures": self.failures}
        def quantile(q: float) -> float:
            return seconds[min(len(seconds) - 1, int(q * len(seconds)))]

        return {
            "probes": len(seconds),
            "failures": self.failures,
            "median": quantile(0.5),
            "p90": quantile(0.9),
            "max": seconds[-1],
            "samples": [[round(t - since, 3), round(s, 4)] for t, s in self.samples],
        }


class GpuMemory(_Sampler):
    """Peaks of GPU memory while it runs: per process (nvidia-smi, MiB -> bytes) and device-wide."""

    thread_name = "gpu-memory"

    def __init__(self, interval_s: float = 1.0) -> None:
        import torch

        super().__init__(interval_s)
        self.enabled = torch.cuda.is_available()
        self.nvidia_smi = shutil.which("nvidia-smi") if self.enabled else None
        self.peak_by_pid: dict[int, int] = {}
        self.peak_device_used = 0

    def sample(self) -> None:
        if not self.enabled:
            return
        try:
            self._sample()
        except (OSError, subprocess.SubprocessError, RuntimeError):
            pass  # a missed sample; the next one counts

    def _sample(self) -> None:
        import torch

        free, total = torch.cuda.mem_get_info()
        self.peak_device_used = max(self.peak_device_used, total - free)
        if self.nvidia_smi is None:
            return
        out = subprocess.run(
            [self.nvidia_smi, "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        ).stdout
        for line in out.splitlines():
            pid, _, used = line.partition(",")
            if pid.strip().isdigit() and used.strip().isdigit():
                key = int(pid)
                self.peak_by_pid[key] = max(self.peak_by_pid.get(key, 0), int(used) * 2**20)

    def report(self, is_server: Callable[[int], bool]) -> dict[str, Any]:
        """Peaks in bytes: this process (the trainer), the server's processes (`is_server(pid)`), any
        other."""
        me = os.getpid()
        server = [v for pid, v in self.peak_by_pid.items() if pid != me and is_server(pid)]
        others = {str(pid): v for pid, v in self.peak_by_pid.items() if pid != me and not is_server(pid)}
        return {
            "device_used_peak_bytes": self.peak_device_used if self.enabled else None,
            "trainer_process_peak_bytes": self.peak_by_pid.get(me),
            "server_processes_peak_bytes": sum(server) if server else None,
            "other_processes_peak_bytes": others,
            "source": "nvidia-smi --query-compute-apps (per pid), torch.cuda.mem_get_info (device)"
            if self.nvidia_smi else "torch.cuda.mem_get_info (device only: no nvidia-smi)",
        }


class RunRecorder(TrainerCallback):
    """Per logged step: seconds since the run started, the step's metrics, the server's generated
    tokens and the rollout process's CPU seconds; `on_record(recorder)` after each. Stops the run at
    the first step end more than `max_seconds` after the end of step `warmup_steps` (at least 1):
    the steady window `steady_summary` measures, whatever the start-up and compilation took."""

    def __init__(self, *, label: str, max_seconds: float, warmup_steps: int, generated: CounterPoller,
                 on_record: Callable[[RunRecorder], None]) -> None:
        self.label = label
        self.max_seconds = max_seconds
        self.warmup_steps = max(1, warmup_steps)
        self.generated = generated
        self.on_record = on_record
        self.started = time.perf_counter()
        self.steps: list[dict[str, float]] = []
        self.stopped_by_time = False
        self.trainer: Any = None  # set by the caller after construction (to read the weight transport)
        self.transport: str | None = None

    def elapsed_s(self) -> float:
        return time.perf_counter() - self.started

    def steady_s(self) -> float:
        """Seconds since the last warm-up step ended (0 before)."""
        if len(self.steps) < self.warmup_steps:
            return 0.0
        return self.elapsed_s() - self.steps[self.warmup_steps - 1]["t_s"]

    def on_step_end(self, args, state, control, **kwargs):
        if self.transport is None and self.trainer is not None and self.trainer.weights is not None:
            # "CollectiveTransport(gloo)", "IpcTransport(embedded)", ...
            self.transport = str(self.trainer.weights)
        if self.steady_s() > self.max_seconds:
            self.stopped_by_time = True
            control.should_training_stop = True
        return control

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not logs or "perf/step_s" not in logs:
            return
        # the poller's latest reading for the progress line; `fill_generated` puts in the value at t_s
        record = {
            "step": state.global_step,
            "t_s": self.elapsed_s(),
            "generated_tokens": self.generated.latest(),
            "rollout_cpu_s": rollout_cpu_s(),
        }
        record.update({k: float(v) for k, v in logs.items()
                       if isinstance(v, (int, float)) and (k.startswith("perf/") or k in STEP_KEYS_KEPT)})
        self.steps.append(record)
        self.on_record(self)

    def fill_generated(self) -> None:
        """After the run: each step's generated tokens at the time it was logged, from the poller."""
        for record in self.steps:
            record["generated_tokens"] = self.generated.value_at(self.started + record["t_s"])


def _delta(steps: list[dict], key: str, first: int) -> float | None:
    before, after = steps[first - 1].get(key), steps[-1].get(key)
    return None if before is None or after is None else after - before


def _ratio(numerator: float | None, denominator: float | None) -> float | None:
    return None if numerator is None or not denominator else numerator / denominator


def steady_summary(steps: list[dict[str, float]], warmup_steps: int) -> dict[str, Any]:
    """Rates over the steady steps: those after the first `warmup_steps` (at least one step is left
    out: the window starts where a logged step ended).

    window_s                      t of the last step - t of the last warm-up step
    trained_tokens_per_s          sum of batch/trained_tokens_per_step of the steady steps / window_s
    generated_tokens_per_s        growth of the server's generated-token counter over the window
                                  / window_s
    rollout_cpu_s_per_generated_token, rollout_busy_frac
                                  the rollout process's CPU seconds over the window / generated tokens,
                                  / window_s
    mean_<key>                    mean of every other numeric key over the steady steps that logged it
    total_<key>                   sum over the steady steps, for TOTAL_KEYS and COUNT_KEYS (no mean of
                                  these)
    """
    first = max(1, warmup_steps)
    if len(steps) <= first:
        return {"steady_steps": 0, "note": f"{len(steps)} steps logged, not more than the {first} left out"}
    steady = steps[first:]
    window_s = steps[-1]["t_s"] - steps[first - 1]["t_s"]
    trained = sum(s.get("batch/trained_tokens_per_step", 0.0) for s in steady)
    generated = _delta(steps, "generated_tokens", first)
    cpu_s = _delta(steps, "rollout_cpu_s", first)
    out: dict[str, Any] = {
        "steady_steps": len(steady),
        "window_s": window_s,
        "trained_tokens_per_s": _ratio(trained, window_s),
        "generated_tokens_per_s": _ratio(generated, window_s),
        "rollout_cpu_s_per_generated_token": _ratio(cpu_s, generated),
        "rollout_busy_frac": _ratio(cpu_s, window_s),
    }
    keys = sorted({k for s in steady for k in s} - {"step", "t_s", "generated_tokens", "rollout_cpu_s"})
    for key in keys:
        values = [s[key] for s in steady if key in s and not math.isnan(s[key])]
        if not values:
            continue
        if key in TOTAL_KEYS or key in COUNT_KEYS:
            out[f"total_{key}"] = sum(values)
        if key not in COUNT_KEYS:
            out[f"mean_{key}"] = statistics.fmean(values)
    return out
