"""The `asyncgrpo serve` process: load the model, build and check the engine, listen, stop on a signal.

    flags -> ServeConfig -> load (loading.py) -> EngineConfig -> build_engine (build.py: the parts, the
    execution plan, the self-check) -> Server (app.py: routes) -> listen -> SIGTERM/SIGINT -> stop

This module is where command-line arguments end: `ServeConfig.from_args` freezes them, and everything
below takes configs and collaborators. `ServerThread` runs the same server inside another process (a
trainer's, on one GPU), in threads.

A user error found while loading (a bad flag, a missing model, a model the engine would serve
wrongly) is a `ModelLoadError`: its message is logged without a traceback and the exit status is 2.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import errno
import gc
import logging
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from aiohttp import web

from asyncgrpo.parent_watch import watch_parent
from asyncgrpo.server import protocol as P
from asyncgrpo.server.app import Server
from asyncgrpo.server.build import BLOCK_SIZE, EngineConfig, build_engine
from asyncgrpo.server.engine import warm_up
from asyncgrpo.server.lease import Leases
from asyncgrpo.server.loading import (
    ModelLoadError,
    ServedModel,
    kv_cache_tokens,
    load_served_model,
    resolve_device,
)
from asyncgrpo.server.lora import AdapterRegistry
from asyncgrpo.server.metrics import ServerMetrics
from asyncgrpo.server.routes.common import ServerInfo
from asyncgrpo.server.routes.profile import EngineProfiler
from asyncgrpo.server.step_graphs import HIGHEST_PRIORITY
from asyncgrpo.server.weights import WeightLoader, WeightTransfer

if TYPE_CHECKING:
    from typing_extensions import Self

logger = logging.getLogger(__name__)


async def _serve(config: ServeConfig, server: Server, stop: asyncio.Event | None = None,
                 listening: Callable[[], None] | None = None, engine_stream=None) -> None:
    """Serve until `stop` is set (None: until SIGINT or SIGTERM, in the main thread); `listening` is
    called once the port is open; `engine_stream`: the CUDA stream of the engine thread."""
    loop = asyncio.get_running_loop()
    start_engine(server, loop, engine_stream)
    watchdog = asyncio.ensure_future(server.hold.watch())
    runner = web.AppRunner(server.app(), handler_cancellation=True, access_log=None, shutdown_timeout=5.0)
    await runner.setup()
    site = web.TCPSite(runner, config.host, config.port)
    await site.start()
    logger.info("embedded server for %s listening on http://%s:%d", server.name, config.host, config.port)
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


def start_engine(server: Server, loop: asyncio.AbstractEventLoop, stream=None) -> None:
    """Warm the engine up and start its thread (`stream`: its CUDA stream; None: the default one), the
    metrics following every change of what runs."""
    engine, metrics = server.engine, server.metrics
    warm_up(engine.runner, engine.scheduler)
    # what start-up built (modules, model, tokenizer) lives as long as the server: keep it out of
    # the collector's full passes, which otherwise stall both threads for ~0.1 s every few thousand
    # requests
    gc.collect()
    gc.freeze()

    def update(engine) -> None:
        s = engine.scheduler
        metrics.update(len(s.running), len(s.waiting), s.kv_usage(), engine.stats, s.pool.stats)

    engine.start(loop, on_update=update, stream=stream)


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


@dataclass(frozen=True)
class ServeConfig:
    """`asyncgrpo serve`'s flags (`asyncgrpo.cli_args`; see its help for each), frozen: the only form
    they take below the command line. None where the flag's default depends on the device or the
    model."""

    model: str
    host: str = "127.0.0.1"
    port: int = 8000
    device: str = "cpu"
    dtype: str = "auto"
    max_model_len: int | None = None
    max_num_seqs: int = 256
    kv_cache_tokens: int | None = None
    gpu_memory_utilization: float | None = None
    api_key: str | None = None
    served_model_name: str | None = None
    seed: int = 0
    max_num_batched_tokens: int | None = None  # 8192 on CUDA, 2048 elsewhere
    admission_interval: int = 1
    max_logprobs: int = 20
    enforce_eager: bool = False
    async_scheduling: bool | None = None  # on with CUDA
    prompt_attention: str = "auto"
    return_sampling_mask: bool = False
    profiler_dir: str | None = None
    enable_prefix_caching: bool = True
    weight_transfer_timeout: float = 300.0
    trainer_lease: float = 30.0
    enable_lora: bool = False
    max_lora_rank: int = 16
    max_loras: int = 1
    log_level: str = "info"
    parent_pid: int | None = None

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ServeConfig:
        """The config of parsed `asyncgrpo serve` arguments."""
        return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)})

    @classmethod
    def of(cls, model: str, *flags: str) -> ServeConfig:
        """What `asyncgrpo serve MODEL FLAGS...` runs with (a bad flag exits, as on the command line)."""
        from asyncgrpo.cli_args import serve_arguments

        return cls.from_args(serve_arguments(model, *flags))

    @property
    def name(self) -> str:
        """The served model's name (/v1/models, requests' `model`)."""
        return self.served_model_name or self.model

    def batched_tokens(self, device: torch.device) -> int:
        """The token budget of one forward pass on `device`."""
        if self.max_num_batched_tokens is not None:
            return self.max_num_batched_tokens
        return 8192 if device.type == "cuda" else 2048

    def engine(self, device: torch.device, kv_tokens: int) -> EngineConfig:
        """The engine's config on `device`, with a KV cache of `kv_tokens` tokens."""
        return EngineConfig(
            name=self.model, max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.batched_tokens(device),
            kv_cache_tokens=kv_tokens, admission_interval=self.admission_interval,
            enforce_eager=self.enforce_eager,
            async_scheduling=(device.type == "cuda" if self.async_scheduling is None
                              else self.async_scheduling),
            prompt_attention=self.prompt_attention, enable_prefix_caching=self.enable_prefix_caching,
            enable_lora=self.enable_lora, max_loras=self.max_loras, max_lora_rank=self.max_lora_rank,
        )

    def info(self, served: ServedModel, engine: EngineConfig) -> ServerInfo:
        """What the server says about itself, serving `served` with `engine`."""
        spec = P.ServerSpec(
            served_name=self.name,
            max_model_len=served.max_model_len,
            max_num_seqs=self.max_num_seqs,
            max_logprobs=self.max_logprobs,
            vocab_size=served.vocab_size,
            return_sampling_mask=self.return_sampling_mask,
            eos_token_id=served.eos_token_id,
            extra_eos_ids=served.extra_eos_ids,
            media_token_ids=served.media_token_ids,
        )
        return ServerInfo(model=self.model, name=self.name, created=int(time.time()), seed=self.seed,
                          spec=spec, engine=engine)


def build_server(config: ServeConfig) -> Server:
    """Load the model, size the KV cache, build the engine (checked against the model) and the HTTP server
    around it (a user error is a `ModelLoadError`)."""
    device = resolve_device(config.device)
    reserved_before = 0  # what this process already holds is not the server's (a trainer's, in-process)
    if device.type == "cuda":
        torch.cuda.empty_cache()
        reserved_before = torch.cuda.memory_reserved(device)
    served = load_served_model(config.model, device, config.dtype, config.max_model_len)
    kv_tokens = kv_cache_tokens(config.kv_cache_tokens, served, config.max_num_seqs, BLOCK_SIZE,
                                config.gpu_memory_utilization, config.batched_tokens(device), reserved_before)
    engine_config = config.engine(device, kv_tokens)
    info = config.info(served, engine_config)
    metrics = ServerMetrics(info.name)
    engine = build_engine(engine_config, served)
    return Server(
        engine, served, info,
        transfer=WeightTransfer(device, WeightLoader(served.model), config.weight_transfer_timeout),
        leases=Leases(config.trainer_lease),
        metrics=metrics,
        adapters=AdapterRegistry(config.max_loras) if config.enable_lora else None,
        profiler=EngineProfiler(config.profiler_dir, device) if config.profiler_dir else None,
        api_key=config.api_key,
    )


def main(args: argparse.Namespace) -> int:
    """Entry point of `asyncgrpo serve` (arguments from `asyncgrpo.cli_args`)."""
    config = ServeConfig.from_args(args)
    logging.basicConfig(
        level=str(config.log_level).upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    if config.parent_pid is not None:
        exit_with_parent(config.parent_pid)
    try:
        check_port_free(config.host, config.port)  # before minutes of loading, not after
        server = build_server(config)
    except ModelLoadError as exc:  # the user's input: the message says what to change, a traceback would not
        logger.error("%s", exc)
        return 2
    try:
        asyncio.run(_serve(config, server))
    except OSError as exc:  # the port was taken while the model loaded
        if exc.errno != errno.EADDRINUSE:
            raise
        logger.error("%s", port_in_use(config.host, config.port))
        return 2
    return 0


def check_port_free(host: str, port: int) -> None:
    """`ModelLoadError` when the server could not listen on host:port (as it will bind: address reuse on):
    another process listens there, the port needs privileges, or this machine has no such address."""
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    except socket.gaierror as exc:
        raise ModelLoadError(
            cannot_listen(host, port, f"no address found for that name ({exc.strerror})")
        ) from exc
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
    return (f"cannot listen on {host}:{port}: {why}; pass --host 127.0.0.1 (this machine only), 0.0.0.0 "
            "(every interface) or an address of one of this machine's network interfaces")


def port_in_use(host: str, port: int) -> str:
    return (f"cannot listen on {host}:{port}: another process already does (another `asyncgrpo serve` or "
            "vLLM?); stop it, or pass another --port")


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

    >>> with ServerThread(ServeConfig.of("asyncgrpo/tiny-chat", "--port", "8000")) as server:
    ...     ...  # http://127.0.0.1:8000 answers

    The parsed arguments of `asyncgrpo serve` (`cli_args.serve_arguments`) are taken too, frozen here.
    """

    def __init__(self, config: ServeConfig | argparse.Namespace,
                 switch_interval_s: float | None = IN_PROCESS_SWITCH_INTERVAL_S) -> None:
        self.config = config if isinstance(config, ServeConfig) else ServeConfig.from_args(config)
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
        return f"http://{self.config.host}:{self.config.port}"

    def start(self, timeout_s: float = 60.0) -> Self:
        self.server = build_server(self.config)
        self.server.transfer.in_process = True
        if self.server.served.device.type == "cuda":
            # start-up work done before another stream reads it
            torch.cuda.synchronize(self.server.served.device)
            # the highest priority the GPU offers: a decode step's few small kernels go before the blocks of
            # the trainer's long ones still waiting for a multiprocessor, so that generation (which the
            # trainer waits for when it is behind) keeps its pace while the trainer fills the GPU around it
            self.stream = torch.cuda.Stream(self.server.served.device, priority=HIGHEST_PRIORITY)

        async def run() -> None:
            self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
            await _serve(self.config, self.server, self._stop, self._ready.set, self.stream)

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
