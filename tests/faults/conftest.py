"""Fault tests: real embedded server processes (the bundled tiny model on CPU), every wait bounded by
a subprocess or HTTP timeout."""

from __future__ import annotations

import os

import pytest
from fault_helpers import MODEL, TINY

from asyncgrpo.launch import EmbeddedServer

os.environ.setdefault("HF_HUB_OFFLINE", "1")


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
