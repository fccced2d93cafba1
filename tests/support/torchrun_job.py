"""Run a torchrun job for a test: a session of its own, so that on a timeout its ranks and whatever they
started (the rollout process) are killed with it."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time

from asyncgrpo.launch import free_port


def run_torchrun(args: list[str], *, nproc: int, env: dict[str, str],
                 timeout_s: float) -> subprocess.CompletedProcess:
    """`python -m torch.distributed.run --nproc_per_node NPROC ARGS...` on a free local port."""
    return run_torchrun_nodes(args, nnodes=1, nproc=nproc, env=env, timeout_s=timeout_s)[0]


def run_torchrun_nodes(args: list[str], *, nnodes: int, nproc: int, env: dict[str, str],
                       timeout_s: float) -> list[subprocess.CompletedProcess]:
    """One torchrun per node (`--nnodes NNODES --node_rank i`), all on this machine and one rendezvous
    port, as a multi-node launch starts them on separate hosts. Returns each node's result."""
    port = str(free_port())
    cmds = [[sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
             *(["--nnodes", str(nnodes), "--node_rank", str(node)] if nnodes > 1 else []),
             "--master_addr", "127.0.0.1", "--master_port", port, *args] for node in range(nnodes)]
    procs = [subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              start_new_session=True) for cmd in cmds]
    results, deadline = [], time.monotonic() + timeout_s
    for cmd, proc in zip(cmds, procs):
        try:
            stdout, stderr = proc.communicate(timeout=max(deadline - time.monotonic(), 1))
        except subprocess.TimeoutExpired:
            for other in procs:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(other.pid, signal.SIGKILL)
            stdout, stderr = proc.communicate()
            stderr += f"\n(killed after {timeout_s:.0f}s)"
        results.append(subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr))
    return results
