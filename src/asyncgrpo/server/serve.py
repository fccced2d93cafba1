"""The `asyncgrpo serve` process: load the model, check the engine against it, listen, stop on a signal.

    load (loading.py) -> Server (app.py) -> self-check (self_check.py) -> listen -> SIGTERM/SIGINT -> stop

`ServerThread` runs the same server inside another process (a trainer's, on one GPU), in threads.

A user error found while loading (a bad flag, a missing model, a model the engine would serve
wrongly) is a `ModelLoadError`: its message is logged without a traceback and the exit status is 2.
"""

from __future__ import annotations

import argparse
import asyncio
import errno
import logging
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from aiohttp import web

from asyncgrpo.parent_watch import watch_parent
from asyncgrpo.server.app import BLOCK_SIZE, Server
from asyncgrpo.server.loading import ModelLoadError, kv_cache_tokens, load_served_model, resolve_device
from asyncgrpo.server.self_check import SelfCheckError, check_engine
from asyncgrpo.server.step_graphs import HIGHEST_PRIORITY

if TYPE_CHECKING:
    from typing_extensions import Self

logger = logging.getLogger(__name__)


async def _serve(args: argparse.Namespace, server: Server, stop: asyncio.Event | None = None,
                 listening: Callable[[], None] | None = None, engine_stream=None) -> None:
    """Serve until `stop` is set (None: until SIGINT or SIGTERM, in the main thread); `listening` is
    called once the port is open; `engine_stream`: the CUDA stream of the engine thread."""
    loop = asyncio.get_running_loop()
    server.start_engine(loop, engine_stream)
    watchdog = asyncio.ensure_future(server.watch_leases())
    runner = web.AppRunner(server.app(), handler_cancellation=True, access_log=None, shutdown_timeout=5.0)
    await runner.setup()
    site = web.TCPSite(runner, args.host, args.port)
    await site.start()
    logger.info("embedded server for %s listening on http://%s:%d", server.name, args.host, args.port)
    if stop is None:
        stop = asyncio.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
    if listening is not None:
        listening()
    await stop.wait()
    logger.info("shutting down")
    server.stopping.set()
    watchdog.cancel()
    server.engine.stop()  # in-flight requests end with an error instead of holding the shutdown
    await runner.cleanup()


def exit_with_parent(parent_pid: int, interval_s: float = 1.0, grace_s: float = 30.0) -> threading.Thread:
    """Watch the process that started this one: once it is gone, send ourselves SIGTERM -- a clean
    shutdown once serving, an immediate exit while still loading -- and exit hard if that has not
    finished after grace_s. Returns the (daemon) watcher thread."""

    def gone() -> None:
        logger.warning("the launching process %d is gone; shutting down", parent_pid)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(grace_s)
        logger.error("shutdown did not finish within %.0f s of the launcher's exit; exiting", grace_s)
        os._exit(1)

    return watch_parent(parent_pid, gone, interval_s)


def build_server(args: argparse.Namespace) -> Server:
    """Load the model, size the KV cache, build the server and check its engine against the model (a
    user error is a `ModelLoadError`)."""
    device = resolve_device(args.device)
    if args.max_num_batched_tokens is None:
        args.max_num_batched_tokens = 8192 if device.type == "cuda" else 2048
    reserved_before = 0  # what this process already holds is not the server's (a trainer's, in-process)
    if device.type == "cuda":
        torch.cuda.empty_cache()
        reserved_before = torch.cuda.memory_reserved(device)
    served = load_served_model(args.model, device, args.dtype, args.max_model_len)
    kv_tokens = kv_cache_tokens(args.kv_cache_tokens, served, args.max_num_seqs, BLOCK_SIZE,
                                args.gpu_memory_utilization, args.max_num_batched_tokens, reserved_before)
    server = Server(args, served, kv_tokens)
    # --prompt-attention: the runner packs prompt chunks where FlashAttention's check passed (auto), never
    # (padded); flash_varlen insists, and an engine that then fails the model's self-check is refused
    if args.prompt_attention == "flash_varlen" and not server.runner.varlen_prompts:
        raise ModelLoadError(
            "--prompt-attention flash_varlen: FlashAttention's variable-length kernel does not serve this model "
            f"here (it needs CUDA, fp16/bf16, no soft-capped layers, and its start-up check; device {served.device}, "
            f"{served.dtype}); use --prompt-attention auto or padded"
        )

    def check() -> None:
        check_engine(server.runner, server.scheduler, served.model, vocab_size=served.vocab_size, dtype=served.dtype,
                     device=served.device, name=args.model)

    try:
        check()
    except SelfCheckError as exc:
        if not (server.runner.varlen_prompts and args.prompt_attention == "auto"):
            raise
        # the packed prompt attention passed its own check but not the whole model's: serve what is known to
        # be right (the check's cached prompt block was computed the packed way: forget it)
        logger.warning("%s\nwith prompt chunks packed for FlashAttention; serving with padded prompt chunks instead "
                       "(what --prompt-attention padded asks for)", exc)
        server.runner.varlen_prompts = False
        server.scheduler.invalidate_prefix_cache()
        check()
    return server


def main(args: argparse.Namespace) -> int:
    """Entry point of `asyncgrpo serve` (arguments from `asyncgrpo.cli`)."""
    logging.basicConfig(
        level=str(args.log_level).upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    if args.parent_pid is not None:
        exit_with_parent(args.parent_pid)
    try:
        check_port_free(args.host, args.port)  # before minutes of loading, not after
        server = build_server(args)
    except ModelLoadError as exc:  # the user's input: the message says what to change, a traceback would not
        logger.error("%s", exc)
        return 2
    try:
        asyncio.run(_serve(args, server))
    except OSError as exc:  # the port was taken while the model loaded
        if exc.errno != errno.EADDRINUSE:
            raise
        logger.error("%s", port_in_use(args.host, args.port))
        return 2
    return 0


def check_port_free(host: str, port: int) -> None:
    """`ModelLoadError` when the server could not listen on host:port (as it will bind: address reuse on):
    another process listens there, the port needs privileges, or this machine has no such address."""
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    except socket.gaierror as exc:
        raise ModelLoadError(cannot_listen(host, port, f"no address found for that name ({exc.strerror})")) from exc
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise ModelLoadError(port_in_use(host, port)) from exc
            if exc.errno == errno.EACCES:
                raise ModelLoadError(f"cannot listen on {host}:{port}: ports below 1024 need administrator "
                                     "rights; pass a --port of 1024 or more") from exc
            why = ("no network interface of this machine has that address" if exc.errno == errno.EADDRNOTAVAIL
                   else exc.strerror or str(exc))
            raise ModelLoadError(cannot_listen(host, port, why)) from exc


def cannot_listen(host: str, port: int, why: str) -> str:
    return (f"cannot listen on {host}:{port}: {why}; pass --host 127.0.0.1 (this machine only), 0.0.0.0 (every "
            "interface) or an address of one of this machine's network interfaces")


def port_in_use(host: str, port: int) -> str:
    return (f"cannot listen on {host}:{port}: another process already does (another `asyncgrpo serve` or vLLM?); "
            "stop it, or pass another --port")


# the interpreter's switch interval while a server runs inside this process (Python's default: 5 ms). Every
# torch call of the engine thread lets go of the interpreter lock, and taking it back waits until the
# thread holding it lets go: a trainer thread busy in plain Python (collating, packing, logging) keeps it
# for a whole interval each time (bench/in_process_gil.py)
IN_PROCESS_SWITCH_INTERVAL_S = 0.0002


class ServerThread:
    """The embedded server inside this process: its HTTP loop in a thread, its engine thread on a CUDA
    stream of its own (CUDA, of the highest priority), so that its kernels may run beside this process's
    (a trainer's) on one GPU instead of taking turns with another process's. Weights still move through
    the weight-transfer routes (CUDA IPC on one GPU, which recognises its own process's buffer).

    The threads share this process's interpreter lock: while the server runs, the interpreter switches
    threads every `switch_interval_s` (None: leave it as it is) instead of Python's 5 ms.

    >>> with ServerThread(serve_arguments("asyncgrpo/tiny-chat", "--port", "8000")) as server:
    ...     ...  # http://127.0.0.1:8000 answers
    """

    def __init__(self, args: argparse.Namespace, switch_interval_s: float | None = IN_PROCESS_SWITCH_INTERVAL_S) -> None:
        self.args = args
        self.switch_interval_s = switch_interval_s
        self._switch_before: float | None = None  # the interval to restore at stop
        self.server: Server | None = None
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._ready = threading.Event()
        self.error: BaseException | None = None
        self.stream: torch.cuda.Stream | None = None  # the engine thread's (CUDA)

    @property
    def url(self) -> str:
        return f"http://{self.args.host}:{self.args.port}"

    def start(self, timeout_s: float = 60.0) -> Self:
        self.server = build_server(self.args)
        self.server.transfer.in_process = True
        if self.server.served.device.type == "cuda":
            torch.cuda.synchronize(self.server.served.device)  # start-up work done before another stream reads it
            # the highest priority the GPU offers: a decode step's few small kernels go before the blocks of
            # the trainer's long ones still waiting for a multiprocessor, so that generation (which the
            # trainer waits for when it is behind) keeps its pace while the trainer fills the GPU around it
            self.stream = torch.cuda.Stream(self.server.served.device, priority=HIGHEST_PRIORITY)

        async def run() -> None:
            self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
            await _serve(self.args, self.server, self._stop, self._ready.set, self.stream)

        def target() -> None:
            try:
                asyncio.run(run())
            except BaseException as exc:  # reported to the thread that waits for start-up
                self.error = exc
                self._ready.set()
                raise

        if self.switch_interval_s is not None:
            self._switch_before = sys.getswitchinterval()
            sys.setswitchinterval(min(self.switch_interval_s, self._switch_before))
        self._thread = threading.Thread(target=target, name="asyncgrpo-server", daemon=True)
        self._thread.start()
        if not self._ready.wait(timeout_s) or self.error is not None:
            self.stop(timeout_s=5)  # (what it changed in this process goes back)
            raise RuntimeError(f"the in-process embedded server did not start: {self.error!r}")
        return self

    def stop(self, timeout_s: float = 30.0) -> None:
        if self._thread is None:
            return
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(timeout_s)
        self._thread = None
        if self._switch_before is not None:
            sys.setswitchinterval(self._switch_before)
            self._switch_before = None

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
