"""Weight-transfer inits that cannot complete (an address where no trainer listens) neither use up
the server nor keep it from stopping: one init runs at a time, later ones are refused with 409, the
pending one fails within --weight-transfer-timeout, and SIGTERM stops the server promptly."""

from __future__ import annotations

import signal
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from fault_helpers import TINY, call

pytestmark = pytest.mark.process


def _dead_port() -> int:
    """A port nothing listens on (bound, then closed)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _init_info(port: int) -> dict:
    return {"init_info": {"backend": "gloo", "master_address": "127.0.0.1", "master_port": port,
                          "rank_offset": 1, "world_size": 2, "packed": True,
                          "packed_buffer_size_bytes": 1 << 20}}


@pytest.mark.slow
def test_inits_to_a_dead_address_are_bounded_and_sigterm_still_stops_the_server(tmp_path):
    from asyncgrpo.launch import EmbeddedServer

    server = EmbeddedServer(TINY, log_path=tmp_path / "server.log",
                            extra_args=["--max-model-len", "256", "--weight-transfer-timeout", "2"]).start()
    try:
        port = _dead_port()
        with ThreadPoolExecutor(8) as pool:
            futures = [pool.submit(call, server.url, "POST", "/init_weight_transfer_engine", _init_info(port),
                                   None, 30) for _ in range(8)]
            time.sleep(1.0)
            # the pool of the server is not used up: generation and control routes still answer at once
            t0 = time.monotonic()
            status, _ = call(server.url, "POST", "/v1/completions",
                             {"prompt": "hi", "max_tokens": 2}, timeout=10)
            assert status == 200 and time.monotonic() - t0 < 5
            results = [f.result(timeout=30) for f in futures]
        statuses = sorted(s for s, _ in results)
        assert statuses.count(409) == 7, results
        refused = next(body for s, body in results if s == 409)
        assert "already in progress" in refused["error"]["message"]
        failed = next(body for s, body in results if s != 409)
        assert failed["error"]["code"] == 500 and f"127.0.0.1:{port}" in failed["error"]["message"]
        # the failed init left nothing behind: a new one is accepted (and fails the same way)
        pending = ThreadPoolExecutor(1).submit(call, server.url, "POST", "/init_weight_transfer_engine",
                                               _init_info(port), None, 30)
        time.sleep(0.5)
        t0 = time.monotonic()
        server.process.send_signal(signal.SIGTERM)
        server.process.wait(timeout=15)
        assert time.monotonic() - t0 < 5
        assert pending.result(timeout=30)[0] == 503  # answered, not left hanging
    finally:
        server.stop()
