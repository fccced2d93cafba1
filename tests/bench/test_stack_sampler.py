"""bench/stack_sampler + bench/stack_report.py: a process started with the sampler on PYTHONPATH records
its main thread's stacks and CPU time, and the report finds where it was busy, where it held the interpreter
lock, and where it was busy but shared the lock with another thread."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))

from stack_report import report

pytestmark = pytest.mark.process

PROGRAM = """
import random
import threading
import time

def sleep(seconds):  # a wait, as an idle event loop's select is: not busy
    time.sleep(seconds)

def stuck_in_python():  # the main thread busy in Python code for 0.8 s: the sampler runs beside it
    end = time.monotonic() + 0.8
    while time.monotonic() < end:
        pass

def spin(seconds):
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass

def sharing_the_lock():  # busy in Python for 0.8 s while another thread spins too: about half the CPU
    other = threading.Thread(target=spin, args=(0.8,))
    other.start()
    spin(0.8)
    other.join()

def holding_the_lock(data):  # one call into C that keeps the interpreter lock (a sort): no sample meanwhile
    return sorted(data)

start = time.monotonic()
holding_the_lock([random.random() for _ in range(100_000)])
data = [random.random() for _ in range(int(100_000 * 0.8 / (time.monotonic() - start)))]  # ~0.8 s to sort

sleep(0.3)
stuck_in_python()
sleep(0.3)
sharing_the_lock()
sleep(0.3)
start = time.monotonic()
holding_the_lock(data)
print(time.monotonic() - start)
sleep(0.3)
"""


def test_the_report_finds_a_busy_stretch_in_python_and_a_gap_while_the_lock_was_held(tmp_path):
    env = dict(os.environ, ASYNCGRPO_STACK_SAMPLES=str(tmp_path / "stacks"),
               ASYNCGRPO_STACK_INTERVAL_S="0.02",
               PYTHONPATH=os.pathsep.join([str(BENCH / "stack_sampler"), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, "-c", PROGRAM], check=False, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    held_s = float(done.stdout)
    (proc,) = report(tmp_path / "stacks", min_s=0.4)
    assert proc["samples"] > 20
    # the busy loop is a stretch of its own (the sleeps around it are waits)
    (stretch,) = [b for b in proc["busy"] if dict(b["functions"]).get("<string>:stuck_in_python", 0) >= 0.8]
    assert stretch["seconds"] >= 0.6, proc["busy"]
    assert stretch["main_thread_cpu_s"] >= 0.5 * stretch["seconds"], stretch
    # with a second thread taking the lock in turns, the main thread runs about half the stretch
    (shared,) = [b for b in proc["busy"] if dict(b["functions"]).get("<string>:sharing_the_lock", 0) >= 0.8]
    assert shared["main_thread_cpu_s"] < 0.8 * shared["seconds"], shared
    assert shared["process_cpu_s"] >= shared["main_thread_cpu_s"] + 0.2 * shared["seconds"], shared
    assert held_s >= 0.5
    gaps = [g for g in proc["gaps"] if any("holding_the_lock" in f for f in g["before"] + g["after"])]
    assert gaps and gaps[0]["seconds"] >= 0.4, (held_s, proc["gaps"])
