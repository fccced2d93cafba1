"""A pause whose holder is gone ends when its lease does, whatever the server's clock went through: the
server is frozen (SIGSTOP) while a trainer holds a pause; the trainer fails on its timeout and exits; the
server is thawed (SIGCONT) and must resume generation within the lease."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support.scripts import script_env
from fault_helpers import TINY, call

pytestmark = pytest.mark.process

LEASE_S = 3.0
TRAINER_TIMEOUT_S = 4.0


@pytest.fixture
def frozen_server(tmp_path):
    from asyncgrpo.launch import EmbeddedServer

    with EmbeddedServer(
        TINY,
        log_path=tmp_path / "server.log",
        extra_args=["--max-model-len", "256", "--trainer-lease", str(LEASE_S)],
    ) as s:
        yield s
        os.kill(s.process.pid, signal.SIGCONT)  # never leave it stopped (stop() would wait on it)


def _paused(server) -> bool:
    return call(server.url, "GET", "/is_paused", timeout=10)[1]["is_paused"]


@pytest.mark.slow
@pytest.mark.parametrize("frozen_for_s", [2 * TRAINER_TIMEOUT_S])
def test_a_pause_held_through_a_freeze_ends_within_its_lease_after_the_thaw(
    frozen_server, frozen_for_s, tmp_path
):
    errors = (tmp_path / "trainer.err").open("w")
    trainer = subprocess.Popen(
        [
            sys.executable,
            str(Path(__file__).with_name("pausing_trainer.py")),
            frozen_server.url,
            str(LEASE_S),
            str(TRAINER_TIMEOUT_S),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=errors,
        text=True,
        env=script_env(Path(__file__)),
    )
    try:
        line = trainer.stdout.readline().strip()
        assert line == "PAUSED", (tmp_path / "trainer.err").read_text()[-3000:]
        assert _paused(frozen_server)
        os.kill(frozen_server.process.pid, signal.SIGSTOP)
        frozen_at = time.monotonic()
        trainer.stdin.write("go\n")
        trainer.stdin.flush()
        out, _ = trainer.communicate(timeout=120)  # the trainer fails on its timeouts and exits
        time.sleep(max(0.0, frozen_for_s - (time.monotonic() - frozen_at)))
    finally:
        os.kill(frozen_server.process.pid, signal.SIGCONT)
        if trainer.poll() is None:
            trainer.kill()
    assert "FAILED" in out, out[-2000:]
    thawed_at = time.monotonic()
    while _paused(frozen_server):
        waited = time.monotonic() - thawed_at
        assert waited < LEASE_S + 3.0, (
            f"still paused {waited:.0f} s after the thaw; trainer said:\n{out[-1500:]}"
        )
        time.sleep(0.2)
    status, _ = call(
        frozen_server.url, "POST", "/v1/completions", {"prompt": "hi", "max_tokens": 2}, timeout=30
    )
    assert status == 200
