"""Run a torchrun job for a test: a session of its own, so that on a timeout its ranks and whatever they
started (the rollout process) are killed with it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

from asyncgrpo.launch import free_port


def run_torchrun(args: list[str], *, nproc: int, env: dict[str, str],
                 timeout_s: float) -> subprocess.CompletedProcess:
    """`python -m torch.distributed.run --nproc_per_node NPROC ARGS...` on a free local port."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
           "--master_addr", "127.0.0.1", "--master_port", str(free_port()), *args]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        stderr += f"\n(killed after {timeout_s:.0f}s)"
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)
