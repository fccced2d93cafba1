"""The embedded server inside this process (`ServerThread`, for one GPU shared with a trainer): it serves
over HTTP like `asyncgrpo serve`, its engine runs in this process, it refuses a weight transfer that
would need this process to be the other rank of a collective group, and it stops cleanly."""

from __future__ import annotations

import json
import os
import threading
import urllib.error
import urllib.request

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch
from test_hybrid_server import post  # one HTTP POST helper for the integration tests

from asyncgrpo.cli import serve_arguments
from asyncgrpo.launch import free_port
from asyncgrpo.server.serve import ServerThread
from asyncgrpo.train.server_link import ServerLink
from asyncgrpo.train.weight_push import make_transport


def test_a_server_thread_serves_refuses_collectives_and_stops():
    port = free_port()
    args = serve_arguments("asyncgrpo/tiny-chat", "--port", str(port), "--max-model-len", "256",
                           "--async-scheduling")
    with ServerThread(args) as running:
        assert running.url == f"http://127.0.0.1:{port}"
        assert any(t.name == "asyncgrpo-engine" for t in threading.enumerate())  # the engine is in this process
        status, body = post(running, "/inference/v1/generate",
                            {"token_ids": [1, 2, 3, 4], "sampling_params": {"max_tokens": 5, "ignore_eos": True,
                                                                           "temperature": 1.0, "seed": 3}})
        assert status == 200 and len(body["choices"][0]["token_ids"]) == 5
        status, body = post(running, "/init_weight_transfer_engine",
                            {"init_info": {"master_address": "127.0.0.1", "master_port": free_port(),
                                           "rank_offset": 1, "world_size": 2}})
        assert status == 500 and "inside the trainer's process" in json.dumps(body)
        # a trainer in this process picks gloo for a CPU server: it fails at start with the server's reason
        link = ServerLink(running.url, timeout_s=5)  # (its own rendezvous, left waiting, ends in 5 s)
        try:
            with pytest.raises(RuntimeError, match="inside the trainer's process.*CUDA IPC only"):
                make_transport(link, torch.device("cpu"), link.connect().device).init()
        finally:
            link.close()
    assert not any(t.name in ("asyncgrpo-engine", "asyncgrpo-server") and t.is_alive() for t in threading.enumerate())
    try:
        urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
        raise AssertionError("the port still answers after stop()")
    except (urllib.error.URLError, ConnectionError):
        pass
