"""Start and stop an embedded generation server: in a subprocess (demo, tests, benchmarks, any CPU run), or
inside this process on a GPU shared with the trainer (`start_server` picks)."""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from typing_extensions import Self

    from asyncgrpo.server.serve import ServerThread

logger = logging.getLogger(__name__)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class EmbeddedServer:
    """`asyncgrpo serve MODEL` as a child process, stopped by pid on exit; it also stops by itself
    when this process dies without stopping it (killed, crashed).

    >>> with EmbeddedServer("asyncgrpo/tiny-chat") as server:
    ...     print(server.url)
    """

    def __init__(
        self,
        model: str,
        *,
        port: int | None = None,
        device: str = "cpu",
        extra_args: list[str] | None = None,
        log_path: str | Path | None = None,
        startup_timeout_s: float = 120.0,
        env: dict[str, str] | None = None,
    ) -> None:
        self.model = model
        self.port = port or free_port()
        self.device = device
        self.extra_args = list(extra_args or [])
        self.log_path = Path(log_path) if log_path else None
        self.startup_timeout_s = startup_timeout_s
        self.env = env
        self.process: subprocess.Popen | None = None
        self._log_file = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> Self:
        # --parent-pid: the server shuts itself down if this process dies without stopping it
        cmd = [sys.executable, "-m", "asyncgrpo.cli", "serve", self.model, "--port", str(self.port),
               "--device", self.device, "--parent-pid", str(os.getpid()), *self.extra_args]
        env = {**os.environ, "HF_HUB_OFFLINE": "1", **(self.env or {})}
        if self.log_path is not None:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            self._log_file = open(self.log_path, "w")  # noqa: SIM115 -- the child writes to it; closed in stop()
        out = self._log_file or subprocess.DEVNULL
        self.process = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env,
                                        start_new_session=True)
        self._wait_ready()
        return self

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"the embedded server exited with code {self.process.returncode} during start-up"
                    + (f"; see {self.log_path}" if self.log_path else "")
                )
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as response:
                    if response.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.25)
        self.stop()
        raise TimeoutError(f"the embedded server did not answer /health within {self.startup_timeout_s:.0f}s")

    def stop(self, timeout_s: float = 10.0) -> None:
        if self.process is None:
            return
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=timeout_s)
        self.process = None
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def start_server(
    model: str,
    *,
    device: str = "cpu",
    extra_args: list[str] | None = None,
    in_process: bool | None = None,
    log_path: str | Path | None = None,
    startup_timeout_s: float = 600.0,
    env: dict[str, str] | None = None,
) -> EmbeddedServer | ServerThread:
    """Start the embedded server for `model` on `device` and return it started (`.url`, `.stop()`).

    On CUDA it runs inside this process by default (`ServerThread`): its decode steps then run beside a
    trainer's kernels on the one GPU, and weights reach it by CUDA IPC, instead of two processes taking turns
    on the GPU. Elsewhere, or with `in_process=False`, it is `asyncgrpo serve` in a subprocess (the
    in-process server takes weights over CUDA IPC only), with `env` added to its environment.
    `extra_args` are `asyncgrpo serve` flags.
    """
    flags = list(extra_args or [])
    cuda = device.startswith("cuda")
    if in_process is None:
        in_process = cuda
    if in_process and not cuda:
        raise ValueError(f"an in-process server needs a CUDA device (it takes weights over CUDA IPC), got "
                         f"{device!r}; pass in_process=False")
    if in_process:
        from asyncgrpo.server.serve import ServeConfig, ServerThread

        config = ServeConfig.of(model, "--device", device, "--port", str(free_port()), *flags)
        return ServerThread(config).start(timeout_s=startup_timeout_s)
    return EmbeddedServer(model, device=device, extra_args=flags, log_path=log_path,
                          startup_timeout_s=startup_timeout_s, env=env).start()
