"""The embedded server inside this process (`ServerThread`, for one GPU shared with a trainer): it serves
over HTTP like `asyncgrpo serve`, its engine runs in this process (the interpreter switching threads
more often meanwhile), it refuses a weight transfer that would need this process to be the other rank
of a collective group, and it stops cleanly."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
import textwrap
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch
from test_hybrid_server import post  # one HTTP POST helper for the integration tests

from asyncgrpo.launch import free_port
from asyncgrpo.server.serve import IN_PROCESS_SWITCH_INTERVAL_S, ServeConfig, ServerThread
from asyncgrpo.train.server_link import ServerLink
from asyncgrpo.train.weights.choose import full_weight_transport

pytestmark = pytest.mark.process


def test_a_server_thread_serves_refuses_collectives_and_stops():
    port = free_port()
    config = ServeConfig.of("asyncgrpo/tiny-chat", "--port", str(port), "--max-model-len", "256",
                            "--async-scheduling")
    before = sys.getswitchinterval()
    with ServerThread(config) as running:
        assert running.url == f"http://127.0.0.1:{port}"
        # the engine is in this process
        assert any(t.name == "asyncgrpo-engine" for t in threading.enumerate())
        assert sys.getswitchinterval() == pytest.approx(min(IN_PROCESS_SWITCH_INTERVAL_S, before))
        status, body = post(running, "/inference/v1/generate",
                            {"token_ids": [1, 2, 3, 4], "sampling_params": {"max_tokens": 5,
                                                                            "ignore_eos": True,
                                                                           "temperature": 1.0, "seed": 3}})
        assert status == 200 and len(body["choices"][0]["token_ids"]) == 5
        assert post(running, "/start_profile", {})[0] == 404  # no profiler directory: no route, as vLLM
        status, body = post(running, "/init_weight_transfer_engine",
                            {"init_info": {"master_address": "127.0.0.1", "master_port": free_port(),
                                           "rank_offset": 1, "world_size": 2}})
        assert status == 500 and "inside the trainer's process" in json.dumps(body)
        # a trainer in this process picks gloo for a CPU server: it fails at start with the server's reason
        link = ServerLink(running.url, timeout_s=5)
        transport = None
        try:
            transport = full_weight_transport(link, torch.device("cpu"), torch.float32, link.connect().device)
            with pytest.raises(RuntimeError, match="inside the trainer's process.*CUDA IPC only"):
                transport.init()
        finally:
            if transport is not None:
                transport.close()
            link.close()
    assert not any(t.name in ("asyncgrpo-engine", "asyncgrpo-server") and t.is_alive()
                   for t in threading.enumerate())
    assert sys.getswitchinterval() == before  # the interpreter's own again
    try:
        urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
        raise AssertionError("the port still answers after stop()")
    except (urllib.error.URLError, ConnectionError):
        pass


@pytest.mark.slow
def test_a_refused_weight_group_does_not_hold_the_trainer_at_exit():
    """The trainer's side of a group the server refused to join waits for it until its timeout (60 s
    here); the error reaches the trainer at once, and the process exits without waiting for that."""
    script = textwrap.dedent("""
        import torch
        from asyncgrpo.cli import serve_arguments
        from asyncgrpo.launch import free_port
        from asyncgrpo.server.serve import ServerThread
        from asyncgrpo.train.server_link import ServerLink
        from asyncgrpo.train.weights.choose import full_weight_transport
        # (the parsed command line, as the README shows it; ServeConfig.of elsewhere)
        with ServerThread(serve_arguments("asyncgrpo/tiny-chat", "--port", str(free_port()))) as running:
            link = ServerLink(running.url, timeout_s=60)
            transport = full_weight_transport(link, torch.device("cpu"), torch.float32, link.connect().device)
            try:
                transport.init()
            except RuntimeError as exc:
                print("refused:", exc, flush=True)
            finally:
                transport.close()
                link.close()
    """)
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-c", script], check=False,
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert done.returncode == 0, done.stderr[-2000:]
    assert "refused:" in done.stdout and "inside the trainer's process" in done.stdout
    assert time.monotonic() - start < 40  # not the rendezvous' 60 s


def test_prompt_attention_is_chosen_at_start_and_a_flash_request_it_cannot_serve_is_refused():
    from asyncgrpo.server.loading import ModelLoadError
    from asyncgrpo.server.serve import build_server

    config = ServeConfig.of("asyncgrpo/tiny-chat", "--max-model-len", "256",
                            "--prompt-attention", "flash_varlen")
    with pytest.raises(ModelLoadError,
                       match="--prompt-attention flash_varlen.*use --prompt-attention auto or padded"):
        build_server(config)
    for choice in ("auto", "padded"):  # CPU: the padded layouts either way
        server = build_server(ServeConfig.of("asyncgrpo/tiny-chat", "--max-model-len", "256",
                                             "--prompt-attention", choice))
        assert server.engine.runner.plan.packed_prompts is False


def test_packed_prompts_that_fail_the_models_self_check_fall_back_to_padded_ones(monkeypatch, caplog):
    """Where the packed layout would be taken (here: FlashAttention's backends made to run on the CPU and
    pass their check) but computes something else than the model (here: attention outputs of zero), the
    server serves the plan's downgrade, padded prompt chunks, with a warning; asked for explicitly, it
    refuses to start."""
    from asyncgrpo.server.attention import base, varlen
    from asyncgrpo.server.attention.continued import FlashContinued
    from asyncgrpo.server.attention.fresh import FlashFresh
    from asyncgrpo.server.self_check import SelfCheckError
    from asyncgrpo.server.serve import build_server

    monkeypatch.setattr(FlashFresh, "support", base.Support(softcap=False))  # every device and dtype
    monkeypatch.setattr(varlen, "varlen_works_on", lambda *args, **kwargs: True)
    for backend in (FlashFresh, FlashContinued):
        monkeypatch.setattr(backend, "packed", lambda self, q, *args: torch.zeros_like(q))
    with caplog.at_level("WARNING", logger="asyncgrpo.server.self_check"):
        server = build_server(ServeConfig.of("asyncgrpo/tiny-chat", "--max-model-len", "256"))
    assert server.engine.runner.plan.packed_prompts is False
    assert "serving with padded prompt chunks instead" in caplog.text
    with pytest.raises(SelfCheckError):
        build_server(ServeConfig.of("asyncgrpo/tiny-chat", "--max-model-len", "256", "--prompt-attention",
                                    "flash_varlen"))


def test_the_profiling_routes_write_a_trace_and_a_summary_of_the_engines_steps(tmp_path):
    generate = {"token_ids": [1, 2, 3, 4], "sampling_params": {"max_tokens": 6, "ignore_eos": True,
                                                                "temperature": 1.0, "seed": 3}}
    config = ServeConfig.of("asyncgrpo/tiny-chat", "--port", str(free_port()), "--max-model-len", "256",
                            "--profiler-dir", str(tmp_path / "profiles"))
    with ServerThread(config) as running:
        assert post(running, "/stop_profile", {})[0] == 409  # not started
        assert post(running, "/start_profile", {})[0] == 200
        assert post(running, "/start_profile", {})[0] == 409  # one at a time
        assert post(running, "/inference/v1/generate", generate)[0] == 200
        status, body = post(running, "/stop_profile", {})
        assert status == 200 and body["num_events"] > 0
        trace, summary = Path(body["trace"]), Path(body["summary"])
        assert trace.parent == summary.parent == tmp_path / "profiles"
        assert json.loads(gzip.decompress(trace.read_bytes()))["traceEvents"]  # a Chrome trace
        assert "aten::" in summary.read_text()  # the engine thread's operators (its forward passes)
        assert post(running, "/inference/v1/generate", generate)[0] == 200  # serving goes on
