"""A dead trainer leaves nothing behind on the embedded server, and a live one cannot be displaced:
the pause carries a lease, a new trainer resumes a paused server and takes over a half-finished
update, and a second trainer is refused at start with a message saying what to do (items 6 and 9)."""

from __future__ import annotations

import logging
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from fault_helpers import TINY, call

from asyncgrpo.train.server_link import ServerLink
from asyncgrpo.train.weights.collective import CollectiveTransport

pytestmark = pytest.mark.process

LEASE_S = 2.0


@pytest.fixture(scope="module")
def leased_server(tmp_path_factory):
    from asyncgrpo.launch import EmbeddedServer

    log = tmp_path_factory.mktemp("server") / "server.log"
    with EmbeddedServer(
        TINY, log_path=log, extra_args=["--max-model-len", "256", "--trainer-lease", str(LEASE_S)]
    ) as s:
        yield s


@pytest.fixture(scope="module")
def tiny_weights():
    from asyncgrpo.modeling.load import load_causal_lm

    model = load_causal_lm(TINY, dtype=torch.float32)
    return [(n, p.detach()) for n, p in model.named_parameters()]


def _paused(server) -> bool:
    return call(server.url, "GET", "/is_paused")[1]["is_paused"]


def _wait_unpaused(server, within_s: float) -> float:
    t0 = time.monotonic()
    while _paused(server):
        assert time.monotonic() - t0 < within_s, f"still paused after {within_s} s"
        time.sleep(0.2)
    return time.monotonic() - t0


@pytest.mark.slow
def test_a_pause_nobody_renews_runs_out_and_generation_resumes(leased_server):
    assert call(leased_server.url, "POST", "/pause?mode=keep") == (200, {"status": "paused"})  # vLLM-shaped
    waited = _wait_unpaused(leased_server, within_s=LEASE_S + 5)
    assert waited >= LEASE_S - 0.5
    assert "the pause lease ran out" in Path(leased_server.log_path).read_text()
    status, _ = call(
        leased_server.url, "POST", "/v1/completions", {"prompt": "hi", "max_tokens": 2}, timeout=10
    )
    assert status == 200


def test_lease_zero_keeps_vllms_pause_and_bad_leases_are_400(leased_server):
    assert call(leased_server.url, "POST", "/pause?mode=keep&lease_s=0")[0] == 200
    time.sleep(LEASE_S + 1.5)
    assert _paused(leased_server)
    assert call(leased_server.url, "POST", "/resume")[0] == 200 and not _paused(leased_server)
    for bad in ("-1", "abc", "inf"):
        status, body = call(leased_server.url, "POST", f"/pause?mode=keep&lease_s={bad}")
        assert status == 400 and "lease_s" in body["error"]
    assert not _paused(leased_server)


def test_renewals_keep_a_pause_held_past_its_lease(leased_server):
    link = ServerLink(leased_server.url, timeout_s=30)
    try:
        link.connect()
        link._run(link.client.pause(mode="keep"))
        time.sleep(2.5 * LEASE_S)  # the link renews every LEASE_S / 3 s
        assert _paused(leased_server)
    finally:
        link._run(link.client.resume())
        link.close()


def test_a_trainer_killed_mid_update_is_taken_over_by_the_next(leased_server, tiny_weights, caplog):
    dying = subprocess.run(
        [sys.executable, str(Path(__file__).with_name("dying_trainer.py")), leased_server.url],
        capture_output=True,
        text=True,
        timeout=90,
        check=False,
    )
    assert "MID-UPDATE" in dying.stdout and dying.returncode == -9, dying.stderr[-2000:]
    assert _paused(leased_server)
    link = ServerLink(leased_server.url, timeout_s=30)
    try:
        with caplog.at_level(logging.WARNING, logger="asyncgrpo.train.server_link"):
            link.connect()  # at once: the dead trainer's store is gone, no need to wait for its lease
        assert "was paused" in caplog.text and not _paused(leased_server)
        assert call(leased_server.url, "GET", "/weight_info")[1]["weight_version"].endswith("+partial")
        assert "abandoned a weight update left unfinished" in Path(leased_server.log_path).read_text()
        transport = CollectiveTransport(link, torch.device("cpu"), torch.float32)
        transport.init()
        transport.send(iter(tiny_weights), label="after-takeover")
        assert call(leased_server.url, "GET", "/weight_info")[1] == {"weight_version": "after-takeover"}
        transport.close()
    finally:
        link.close()


def test_a_second_trainer_is_refused_at_start_while_the_first_lives(leased_server, tiny_weights):
    first, second = ServerLink(leased_server.url, timeout_s=30), ServerLink(leased_server.url, timeout_s=30)
    try:
        first.connect()
        transport = CollectiveTransport(first, torch.device("cpu"), torch.float32)
        transport.init()
        time.sleep(2 * LEASE_S)  # renewals keep the first one's hold alive past its lease
        with pytest.raises(
            RuntimeError, match="already initialised by another trainer.*stop the other trainer"
        ):
            second.connect()
        # its weight routes are refused too, and the first trainer's sync is untouched
        status, body = call(
            leased_server.url, "POST", "/start_weight_update", headers={"X-Asyncgrpo-Trainer": "x"}
        )
        assert status == 409 and first.trainer_id in body["error"]["message"]
        transport.send(iter(tiny_weights), label="first")
        transport.close()
        first.close()
        # a trainer that closes gives the server back at once (on a GPU there is no gloo store whose end
        # would tell the server: the next run of a script would wait out the lease)
        assert call(leased_server.url, "GET", "/lease")[1]["holder"] is None
        second.connect()  # the first one is gone: its group went with it
    finally:
        first.close()
        second.close()
