"""Fault tests: real embedded server processes (the bundled tiny model on CPU), every wait bounded by
a subprocess or HTTP timeout."""

from __future__ import annotations

import os

import pytest
from fault_helpers import MODEL, TINY

os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture
def server(embedded_server):
    """The server of the pipeline fault tests, which push weights into it (a purpose of their own)."""
    # asynchronous steps, as on CUDA: weight pushes land between steps while others are in flight
    return embedded_server(MODEL, "--async-scheduling", purpose="trained")


@pytest.fixture
def tiny_server(embedded_server):
    """The bundled tiny model behind a plain embedded server (no key), for request-level faults; a test
    that changes its weight version puts it back."""
    return embedded_server(TINY, "--max-model-len", "256")
