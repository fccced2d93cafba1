"""How the trainer and its generation server share one GPU.

"time-slicing" is CUDA's default: each process has its own context and the GPU runs one context at a
time, switching between them, so a decode step of the server never runs during a matmul of the
trainer. "mps" starts an NVIDIA Multi-Process Service daemon for the run: every process that
initialises CUDA afterwards (this one, the embedded server, the rollout process) submits its work
through one MPS server, and kernels of different processes run on the GPU at the same time.
"in-process" runs the embedded server inside the trainer's process (`asyncgrpo.server.serve.ServerThread`,
its engine on a CUDA stream of its own): one context, whose streams the GPU may run side by side.

    with gpu_sharing("mps", Path("/tmp/run")) as info:   # before the first CUDA call of this process
        ...
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

SHARING_MODES = ("time-slicing", "mps", "in-process")
MPS_CONTROL = "nvidia-cuda-mps-control"


@contextmanager
def gpu_sharing(mode: str, work_dir: Path) -> Iterator[dict]:
    """Runs the body under `mode`; yields what the result JSON records about it. For "mps" this must be
    entered before this process initialises CUDA (the environment decides which server a context joins)."""
    if mode not in SHARING_MODES:
        raise ValueError(f"GPU sharing mode must be one of {SHARING_MODES}, got {mode!r}")
    if mode in ("time-slicing", "in-process"):  # in-process: the caller runs the server in its own process
        yield {"mode": mode}
        return
    control = shutil.which(MPS_CONTROL)
    if control is None:
        raise SystemExit(f"--sharing mps needs {MPS_CONTROL} (from the NVIDIA driver's utilities) on "
                         "PATH, and it is not there: install the driver utilities, or run with "
                         "--sharing time-slicing")
    env = {"CUDA_MPS_PIPE_DIRECTORY": str(work_dir / "mps-pipe"),
           "CUDA_MPS_LOG_DIRECTORY": str(work_dir / "mps-log")}
    for folder in env.values():
        Path(folder).mkdir(parents=True, exist_ok=True)
    started = subprocess.run([control, "-d"], check=False, env={**os.environ, **env}, capture_output=True,
                             text=True, timeout=30)
    if started.returncode != 0:
        raise SystemExit(f"starting the MPS daemon failed ({control} -d exited {started.returncode}: "
                         f"{(started.stderr or started.stdout).strip()}); run with --sharing time-slicing")
    probe_error = _probe_cuda({**os.environ, **env})
    if probe_error:
        subprocess.run([control], check=False, input="quit\n", env={**os.environ, **env}, capture_output=True,
                       text=True, timeout=30)
        raise SystemExit(f"a CUDA client under the MPS daemon {probe_error}; the daemon was stopped: run "
                         "with --sharing time-slicing")
    saved = {key: os.environ.get(key) for key in env}
    os.environ.update(env)  # inherited by the server and the rollout process
    try:
        yield {"mode": mode, **env}
    finally:
        subprocess.run([control], check=False, input="quit\n", env={**os.environ, **env}, capture_output=True,
                       text=True, timeout=30)
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _probe_cuda(env: dict, timeout_s: float = 120.0) -> str | None:
    """Run one small CUDA computation in a child process under `env`; None if it works, else what went
    wrong (a client that cannot reach the daemon may hang rather than fail: the timeout bounds that)."""
    code = "import torch; assert torch.ones(4, device='cuda').sum().item() == 4"
    try:
        done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                              timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired:
        return f"did not finish a one-kernel computation in {timeout_s:.0f} s"
    if done.returncode != 0:
        last = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
        return f"failed a one-kernel computation ({last[0][-300:]})"
    return None
