"""The arithmetic of bench/one_gpu.py against hand-computed values: the steady-window rates of a run,
the comparison of the settings, the reward, and the prompt length it aims for."""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from one_gpu import even_token_fraction, make_prompts
from one_gpu_probes import CounterPoller, RoundTrip, interpolate, served_model, steady_summary
from one_gpu_report import compare_settings
from random_qwen3 import chat_tokenizer, language_for_vocab

STEPS = [
    {"step": 1, "t_s": 10.0, "generated_tokens": 100.0, "rollout_cpu_s": 2.0,
     "batch/trained_tokens_per_step": 50.0, "perf/step_s": 10.0},
    {"step": 2, "t_s": 12.0, "generated_tokens": 300.0, "rollout_cpu_s": 2.5,
     "batch/trained_tokens_per_step": 80.0, "perf/step_s": 2.0, "sample/dropped_stale_count": 3.0},
    {"step": 3, "t_s": 16.0, "generated_tokens": 700.0, "rollout_cpu_s": 3.0,
     "batch/trained_tokens_per_step": 120.0, "perf/step_s": 4.0},
]


def test_steady_summary_rates_cover_the_steps_after_the_warm_up():
    s = steady_summary(STEPS, warmup_steps=1)
    assert s["steady_steps"] == 2 and s["window_s"] == 6.0  # from the end of step 1 to the end of step 3
    assert s["trained_tokens_per_s"] == pytest.approx((80 + 120) / 6)
    assert s["generated_tokens_per_s"] == pytest.approx((700 - 100) / 6)
    assert s["rollout_cpu_s_per_generated_token"] == pytest.approx(1.0 / 600)
    assert s["rollout_busy_frac"] == pytest.approx(1.0 / 6)
    assert s["mean_perf/step_s"] == 3.0
    assert (s["total_batch/trained_tokens_per_step"] == 200.0
            and s["mean_batch/trained_tokens_per_step"] == 100.0)
    # a count logged by one step only: its total, never a mean over the steps that logged it
    assert s["total_sample/dropped_stale_count"] == 3.0 and "mean_sample/dropped_stale_count" not in s
    assert steady_summary(STEPS, warmup_steps=0)["window_s"] == 6.0  # the first step is always left out


def test_steady_summary_without_enough_steps_or_counters():
    assert steady_summary(STEPS, warmup_steps=3)["steady_steps"] == 0
    no_server_counter = [{**s, "generated_tokens": None} for s in STEPS]
    s = steady_summary(no_server_counter, warmup_steps=1)
    assert s["generated_tokens_per_s"] is None and s["rollout_cpu_s_per_generated_token"] is None
    assert s["trained_tokens_per_s"] == pytest.approx(200 / 6)


def test_compare_settings_takes_medians_and_the_async_over_on_policy_ratios():
    def run(setting, trained, sync_s, step_s):
        return {"setting": setting, "summary": {"steady_steps": 3, "trained_tokens_per_s": trained,
                                                "generated_tokens_per_s": 2 * trained,
                                                "mean_perf/weight_sync_s": sync_s,
                                                "mean_perf/step_s": step_s}}

    runs = [run("async", 130.0, 0.05, 2.0), run("on_policy", 100.0, 0.08, 3.0),
            run("async", 150.0, 0.07, 2.0),
            {"setting": "on_policy", "status": "failed: OOM", "summary": {"steady_steps": 0}},
            {"setting": "async", "status": "skipped: 10 s left of --deadline-s"}]
    c = compare_settings(runs)
    assert c["async"]["runs"] == 2 and c["async"]["trained_tokens_per_s"] == 140.0
    assert c["on_policy"]["runs"] == 1
    assert c["async_over_on_policy"]["trained_tokens_per_s"] == pytest.approx(1.4)
    assert c["async_over_on_policy"]["generated_tokens_per_s"] == pytest.approx(1.4)
    assert c["async_over_on_policy"]["step_s"] == pytest.approx(1.5)
    assert c["targets"]["trained_tokens_per_s_async_over_on_policy_at_least_1.3"] is True
    assert c["targets"]["weight_sync_s"] == 0.08 and c["targets"]["weight_sync_s_at_most_0.1"] is True
    only_async = compare_settings(runs[:1])
    assert (only_async["on_policy"] is None
            and only_async["async_over_on_policy"]["trained_tokens_per_s"] is None)


def test_even_token_fraction_reward():
    assert even_token_fraction([[2, 4, 5, 7], [1], [], [0, 0]]) == [0.5, 0.0, 0.0, 1.0]


def test_prompts_are_about_the_requested_length():
    tokenizer = chat_tokenizer(512)
    rows, mean = make_prompts(tokenizer, language_for_vocab(512), num_prompts=80, target_tokens=60, seed=0)
    assert len(rows) == 80 and rows[0]["prompt"][0]["role"] == "user"
    assert 50 <= mean <= 70
    assert rows[0] != rows[1]
    # the language is seeded: the same arguments give the same prompts
    assert make_prompts(tokenizer, language_for_vocab(512), 2, 60, seed=0)[0][0] == rows[0]


def test_time_slicing_changes_nothing(tmp_path, monkeypatch):
    from gpu_sharing import gpu_sharing

    monkeypatch.delenv("CUDA_MPS_PIPE_DIRECTORY", raising=False)
    with gpu_sharing("time-slicing", tmp_path) as info:
        assert info == {"mode": "time-slicing"} and "CUDA_MPS_PIPE_DIRECTORY" not in __import__("os").environ


def test_mps_without_its_control_program_says_what_to_do(tmp_path, monkeypatch):
    from gpu_sharing import gpu_sharing

    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(SystemExit, match="nvidia-cuda-mps-control .* --sharing time-slicing"), \
            gpu_sharing("mps", tmp_path):
        pass


def _stand_in_mps_control(tmp_path: Path, monkeypatch) -> Path:
    """An `nvidia-cuda-mps-control` first on PATH that appends how it is called to the returned file."""
    import os

    bin_dir, calls = tmp_path / "bin", tmp_path / "calls.txt"
    bin_dir.mkdir()
    control = bin_dir / "nvidia-cuda-mps-control"
    control.write_text(f'#!/bin/sh\necho "args=$* pipe=$CUDA_MPS_PIPE_DIRECTORY stdin=$(cat)" >> {calls}\n')
    control.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    return calls


@pytest.mark.process  # runs a stand-in nvidia-cuda-mps-control
def test_mps_starts_a_daemon_for_the_run_and_stops_it(tmp_path, monkeypatch):
    """A stand-in control program records how it is called (the real one needs an NVIDIA driver)."""
    import os

    from gpu_sharing import gpu_sharing

    calls = _stand_in_mps_control(tmp_path, monkeypatch)
    monkeypatch.delenv("CUDA_MPS_PIPE_DIRECTORY", raising=False)
    monkeypatch.setattr(sys.modules["gpu_sharing"], "_probe_cuda", lambda env: None)  # no GPU here
    with gpu_sharing("mps", tmp_path / "run") as info:
        assert (os.environ["CUDA_MPS_PIPE_DIRECTORY"] == info["CUDA_MPS_PIPE_DIRECTORY"]
                == str(tmp_path / "run/mps-pipe"))
    assert "CUDA_MPS_PIPE_DIRECTORY" not in os.environ
    started, stopped = calls.read_text().splitlines()
    assert started.startswith("args=-d pipe=") and stopped.endswith("stdin=quit")


@pytest.mark.process  # runs a stand-in nvidia-cuda-mps-control
def test_mps_whose_clients_cannot_compute_stops_the_daemon_and_says_what_to_do(tmp_path, monkeypatch):
    """The probe, a one-kernel CUDA computation in a child process, fails here (no GPU) as it would
    where MPS clients cannot run: the daemon is stopped and the run refused before any work starts."""
    import os

    from gpu_sharing import gpu_sharing

    calls = _stand_in_mps_control(tmp_path, monkeypatch)
    with pytest.raises(SystemExit,
                       match="one-kernel computation.*daemon was stopped.*--sharing time-slicing"), \
            gpu_sharing("mps", tmp_path / "run"):
        pass
    started, stopped = calls.read_text().splitlines()
    assert started.startswith("args=-d") and stopped.endswith("stdin=quit")
    assert "CUDA_MPS_PIPE_DIRECTORY" not in os.environ


def test_interpolate_between_the_readings_around_a_time_and_the_nearest_outside_them():
    samples = [(1.0, 100.0), (2.0, 300.0), (4.0, 700.0)]
    assert interpolate(samples, 1.5) == 200.0 and interpolate(samples, 3.0) == 500.0
    assert interpolate(samples, 0.0) == 100.0 and interpolate(samples, 9.0) == 700.0
    assert interpolate([], 1.0) is None


def test_the_poller_reads_in_its_own_thread_and_answers_for_a_time_after_the_caller_asked():
    started = time.perf_counter()
    calls = []

    def read():  # a counter growing by 1000 a second, which takes 20 ms to read (its value: mid-read)
        calls.append(threading.current_thread().name)
        time.sleep(0.01)
        value = 1000.0 * (time.perf_counter() - started)
        time.sleep(0.01)
        return value

    with CounterPoller(read, interval_s=0.05) as poller:
        time.sleep(0.1)
        asked = time.perf_counter() + 0.1
        value = poller.value_at(asked)  # waits for a reading after `asked`
    assert set(calls) == {"counter-poller"} and len(poller.read_s) >= 3
    assert abs(value - 1000.0 * (asked - started)) < 15.0  # interpolated: readings are stamped mid-read


def test_the_round_trip_probe_times_one_token_completions_of_the_served_model():
    """A peer that answers /v1/completions after 0.2 s, and refuses other models: the probe asks for the
    served model, and its quantiles and samples say how long the answers took."""
    import json
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    bodies = []

    class Peer(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def _answer(self, status, payload):
            data = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            self._answer(200, {"data": [{"id": "served-model"}]})

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            bodies.append(body)
            time.sleep(0.2)
            ok = body["model"] == "served-model" and body["max_tokens"] == 1
            self._answer(200 if ok else 404, {"choices": [{"text": "x"}]} if ok
                         else {"error": "no such model"})

    server = ThreadingHTTPServer(("127.0.0.1", 0), Peer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        start = time.perf_counter()
        with RoundTrip(url, served_model(url), interval_s=0.05) as probe:
            time.sleep(0.7)
        report = probe.report(since=start)
        assert served_model(url) == "served-model" and probe.failures == 0
        assert 2 <= report["probes"] <= 4 and 0.2 <= report["median"] <= report["max"] < 1.0
        assert all(0 <= t < 1.0 for t, _ in report["samples"]) and bodies[0]["prompt"] == [1, 2, 3]
        with RoundTrip(url, "another-model", interval_s=0.05) as wrong:
            time.sleep(0.3)
        assert wrong.failures >= 1 and wrong.report()["probes"] == 0
    finally:
        server.shutdown()
