"""Fault 2: a trainer killed with SIGKILL leaves nothing running (its rollout process and
multiprocessing's resource tracker die with it)."""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
from support.scripts import script_env

pytestmark = pytest.mark.process

SCRIPT = Path(__file__).with_name("train_until_killed.py")
PROBE = Path(__file__).with_name("orphan_probe.py")


def _alive(procs: list[psutil.Process]) -> list[psutil.Process]:
    alive = []
    for proc in procs:
        try:
            if proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE:
                alive.append(proc)
        except psutil.NoSuchProcess:
            pass
    return alive


@pytest.mark.parametrize("mechanism", ["prctl", "watchdog"])
def test_a_child_that_exits_with_its_parent_dies_when_the_parent_is_sigkilled(mechanism):
    parent = subprocess.Popen([sys.executable, str(PROBE), mechanism], stdout=subprocess.PIPE, text=True)
    child = None
    try:
        child = psutil.Process(int(parent.stdout.readline()))
        assert parent.stdout.readline().strip() == "armed"
        assert _alive([child])
        parent.send_signal(signal.SIGKILL)
        parent.wait(10)
        deadline = time.monotonic() + 5
        while _alive([child]) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive([child]), f"the child outlived its SIGKILLed parent ({mechanism})"
    finally:
        if parent.poll() is None:
            parent.kill()
        if child is not None and _alive([child]):
            child.kill()


@contextlib.contextmanager
def _trainer_after_its_first_step(
        tmp_path, url: str) -> Iterator[tuple[subprocess.Popen, list[psutil.Process]]]:
    """`train_until_killed.py` against `url`, once it has taken a step: (its process, its descendants).
    Whatever is left of them is killed on the way out."""
    env = script_env(SCRIPT)
    log = open(tmp_path / "trainer.log", "w")  # noqa: SIM115 -- closed below
    trainer = subprocess.Popen([sys.executable, str(SCRIPT), url, str(tmp_path)],
                               stdout=log, stderr=log, env=env)
    descendants: list[psutil.Process] = []
    try:
        deadline = time.monotonic() + 180
        while not (tmp_path / "ready").exists():
            assert trainer.poll() is None, (tmp_path / "trainer.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "the trainer took no step within 180 s"
            time.sleep(0.5)
        descendants.extend(psutil.Process(trainer.pid).children(recursive=True))
        yield trainer, descendants
    finally:
        log.close()
        if trainer.poll() is None:
            trainer.kill()
        for proc in _alive(descendants):  # only what this test started
            proc.kill()


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_sigkilled_trainer_leaves_no_descendant_running(tmp_path, server):
    with _trainer_after_its_first_step(tmp_path, server.url) as (trainer, descendants):
        cmdlines = [" ".join(p.cmdline()) for p in descendants]
        assert any("spawn_main" in c for c in cmdlines), f"no rollout process among {cmdlines}"
        assert any("resource_tracker" in c for c in cmdlines), f"no resource tracker among {cmdlines}"

        trainer.send_signal(signal.SIGKILL)
        trainer.wait(10)
        deadline = time.monotonic() + 5
        while _alive(descendants) and time.monotonic() < deadline:
            time.sleep(0.1)
        survivors = [" ".join(p.cmdline()) for p in _alive(descendants)]
        assert not survivors, f"still running 5 s after the trainer was killed: {survivors}"


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_sigtermed_trainer_cleans_up_and_gives_the_server_back_at_once(tmp_path, server):
    """SIGTERM (a scheduler's preemption) stops training as Ctrl-C would: exit status 143, the rollout
    process stopped, and the embedded server's hold given back at once, not after --trainer-lease."""
    from fault_helpers import call

    with _trainer_after_its_first_step(tmp_path, server.url) as (trainer, descendants):
        assert call(server.url, "GET", "/lease")[1]["holder"] is not None
        trainer.send_signal(signal.SIGTERM)
        assert trainer.wait(30) == 128 + signal.SIGTERM
        assert call(server.url, "GET", "/lease")[1]["holder"] is None  # given back, not left to expire
        # the rollout process is joined before exit; multiprocessing's resource tracker leaves once it reads
        # the end of its pipe, a moment after the trainer is gone
        deadline = time.monotonic() + 5
        while _alive(descendants) and time.monotonic() < deadline:
            time.sleep(0.1)
        survivors = [" ".join(p.cmdline()) for p in _alive(descendants)]
        assert not survivors, f"still running 5 s after the trainer exited: {survivors}"
        output = (tmp_path / "trainer.log").read_text()
        assert "SIGTERM: stopping training" in output and "leaked semaphore" not in output, output[-3000:]
