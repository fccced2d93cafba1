"""The `asyncgrpo serve` process: load the model, check the engine against it, listen, stop on a signal.

    load (loading.py) -> Server (app.py) -> self-check (self_check.py) -> listen -> SIGTERM/SIGINT -> stop

A user error found while loading (a bad flag, a missing model, a model the engine would serve
wrongly) is a `ModelLoadError`: its message is logged without a traceback and the exit status is 2.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import threading
import time

from aiohttp import web

from asyncgrpo.parent_watch import watch_parent
from asyncgrpo.server.app import BLOCK_SIZE, Server
from asyncgrpo.server.loading import ModelLoadError, kv_cache_tokens, load_served_model, resolve_device
from asyncgrpo.server.self_check import check_engine

logger = logging.getLogger(__name__)


async def _serve(args: argparse.Namespace, server: Server) -> None:
    loop = asyncio.get_running_loop()
    server.start_engine(loop)
    watchdog = asyncio.ensure_future(server.watch_leases())
    runner = web.AppRunner(server.app(), handler_cancellation=True, access_log=None, shutdown_timeout=5.0)
    await runner.setup()
    site = web.TCPSite(runner, args.host, args.port)
    await site.start()
    logger.info("embedded server for %s listening on http://%s:%d", server.name, args.host, args.port)
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
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


def main(args: argparse.Namespace) -> int:
    """Entry point of `asyncgrpo serve` (arguments from `asyncgrpo.cli`)."""
    logging.basicConfig(
        level=str(args.log_level).upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    if args.parent_pid is not None:
        exit_with_parent(args.parent_pid)
    try:
        device = resolve_device(args.device)
        if args.max_num_batched_tokens is None:
            args.max_num_batched_tokens = 8192 if device.type == "cuda" else 2048
        served = load_served_model(args.model, device, args.dtype, args.max_model_len)
        kv_tokens = kv_cache_tokens(args.kv_cache_tokens, served, args.max_num_seqs, BLOCK_SIZE,
                                    args.gpu_memory_utilization, args.max_num_batched_tokens)
        server = Server(args, served, kv_tokens)
        check_engine(server.runner, server.scheduler, served.model, vocab_size=served.vocab_size, dtype=served.dtype,
                     device=served.device, name=args.model)
    except ModelLoadError as exc:  # the user's input: the message says what to change, a traceback would not
        logger.error("%s", exc)
        return 2
    asyncio.run(_serve(args, server))
    return 0
