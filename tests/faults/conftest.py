"""Fault tests: real embedded server processes (the bundled tiny model on CPU), every wait bounded by
a subprocess or HTTP timeout."""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.request
from typing import Any

import pytest
from fault_helpers import MODEL

from asyncgrpo.launch import EmbeddedServer

os.environ.setdefault("HF_HUB_OFFLINE", "1")

TINY = MODEL


def call(url: str, method: str, path: str, body: Any = None, headers: dict | None = None,
         timeout: float = 30) -> tuple[int, Any]:
    """One HTTP request -> (status, JSON body, else text). `body` bytes are sent as they are."""
    data = body if isinstance(body, bytes) else (json.dumps(body).encode() if body is not None else None)
    req = urllib.request.Request(url + path, data=data, method=method,
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            status, text, ctype = resp.status, resp.read().decode(), resp.headers.get("Content-Type", "")
    except urllib.error.HTTPError as err:
        status, text, ctype = err.code, err.read().decode(), err.headers.get("Content-Type", "")
    return status, (json.loads(text) if text and "json" in ctype else text)


@pytest.fixture(scope="session")
def server(tmp_path_factory):
    """One server shared by the pipeline fault tests (the trainer pushes weights into it)."""
    log = tmp_path_factory.mktemp("server") / "server.log"
    # asynchronous steps, as on CUDA: weight pushes land between steps while others are in flight
    with EmbeddedServer(MODEL, log_path=log, extra_args=["--async-scheduling"]) as s:
        yield s


@pytest.fixture(scope="module")
def tiny_server(tmp_path_factory):
    """The bundled tiny model behind a plain embedded server (no key), for request-level faults."""
    log = tmp_path_factory.mktemp("server") / "server.log"
    with EmbeddedServer(TINY, log_path=log, extra_args=["--max-model-len", "256"]) as server:
        yield server
