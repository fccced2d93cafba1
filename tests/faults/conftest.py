"""One embedded server (CPU, bundled tiny model) shared by the fault tests."""

from __future__ import annotations

import os

import pytest
from fault_helpers import MODEL

from asyncgrpo.launch import EmbeddedServer

os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="session")
def server(tmp_path_factory):
    log = tmp_path_factory.mktemp("server") / "server.log"
    with EmbeddedServer(MODEL, log_path=log) as s:
        yield s
