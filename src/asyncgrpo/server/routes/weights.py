"""Weight routes of the embedded server (vLLM 0.33's weight-transfer protocol, section 2.3): the transfer
group's init and shutdown, an update's start / chunks / finish, the served weights' version and digest.

    GET  /weight_info  /weight_checksum (digests of the served weights; not in vLLM)
    POST /init_weight_transfer_engine  /start_weight_update  /update_weights  /finish_weight_update
         /shutdown_weight_transfer_engine  /update_weight_version

Errors are vLLM's ErrorResponse with 500 (`weights.WeightTransferError`), 409 while another live trainer
holds the server (`lease.TrainerHold`), 412 for a weight delta whose base this server does not hold
(`weights.WeightDeltaRejected`, an extension). Weights load in the engine thread between two steps.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import torch
from aiohttp import web

from asyncgrpo.server import protocol as P
from asyncgrpo.server.engine import Engine
from asyncgrpo.server.metrics import ServerMetrics
from asyncgrpo.server.routes.common import RouteTable, json_response, read_body
from asyncgrpo.server.routes.lease import TrainerHold, trainer_id
from asyncgrpo.server.weights import WeightTransfer
from asyncgrpo.sync import in_daemon_thread
from asyncgrpo.sync.checksum import weights_checksum


class WeightRoutes(RouteTable):
    """The weight-transfer routes over `transfer`, guarded by the trainer hold; `stopping` is set when the
    server shuts down (an init stuck connecting must not hold it)."""

    ROUTES = (
        ("GET", "/weight_info", "weight_info"), ("GET", "/weight_checksum", "weight_checksum"),
        ("POST", "/init_weight_transfer_engine", "init_transfer"),
        ("POST", "/start_weight_update", "start_update"),
        ("POST", "/update_weights", "update_weights"), ("POST", "/finish_weight_update", "finish_update"),
        ("POST", "/shutdown_weight_transfer_engine", "shutdown_transfer"),
        ("POST", "/update_weight_version", "update_weight_version"),
    )

    def __init__(self, engine: Engine, model: torch.nn.Module, transfer: WeightTransfer, hold: TrainerHold,
                 metrics: ServerMetrics, stopping: asyncio.Event) -> None:
        self.engine = engine
        self.model = model
        self.transfer = transfer
        self.hold = hold
        self.metrics = metrics
        self.stopping = stopping
        self._init_started: float | None = None  # monotonic start of the weight-transfer init in progress
        self._num_updates = 0

    async def weight_info(self, request: web.Request) -> web.Response:
        return json_response({"weight_version": self.engine.weight_version})

    async def weight_checksum(self, request: web.Request) -> web.Response:
        """An embedded-server extension (vLLM has no such route): the digest of every served parameter
        (`asyncgrpo.sync.checksum`), taken between engine steps so that no update is half applied."""

        def digests() -> tuple[str, dict[str, str]]:
            params = self.model.named_parameters(remove_duplicate=False)
            return self.engine.weight_version, weights_checksum(params)

        version, tensors = await self.engine.call(digests)
        return json_response({"weight_version": version, "algorithm": "sha256", "tensors": tensors})

    async def init_transfer(self, request: web.Request) -> web.Response:
        """One init at a time, on its own thread, bounded by --weight-transfer-timeout; a second one while
        it runs is refused (409) rather than queued, so inits aimed at a dead address pile up nowhere."""
        body = await read_body(request)
        if self._init_started is not None:
            raise P.ApiError(
                409,
                f"a weight-transfer init is already in progress (started "
                f"{time.monotonic() - self._init_started:.0f} s ago; it succeeds or fails within "
                f"{self.transfer.timeout_s:.0f} s); retry after it ends",
            )
        self._init_started = time.monotonic()
        try:
            await self.hold.admit_init(request)
        except BaseException:
            self._init_started = None
            raise
        init_info = body.get("init_info")
        fut = in_daemon_thread(lambda: self.transfer.init(init_info), "asyncgrpo-weight-init")
        # the next init may start when this one ends, not when its request does
        fut.add_done_callback(lambda _: setattr(self, "_init_started", None))
        with self.metrics.operation("init"):
            await self._unless_stopping(fut)
        self.hold.leases.hold(trainer_id(request), request.remote)
        return json_response({"message": "Weight transfer initialized"})

    async def _unless_stopping(self, fut: asyncio.Future) -> Any:
        """Await fut (shielded: it belongs to a thread) unless the server starts shutting down first:
        SIGTERM must not wait for an init that is stuck connecting."""
        stopping = asyncio.ensure_future(self.stopping.wait())
        try:
            await asyncio.wait({fut, stopping}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopping.cancel()
        if not fut.done():
            raise P.ApiError(503, "the server is shutting down")
        return fut.result()

    async def start_update(self, request: web.Request) -> web.Response:
        async with self.hold.weight_call(request):
            with self.metrics.operation("start"):
                self.transfer.start()
        return json_response({"message": "Weight update started"})

    async def update_weights(self, request: web.Request) -> web.Response:
        body = await read_body(request)
        if "update_info" not in body:
            raise P.ApiError(400, "the body needs update_info", param="update_info")
        async with self.hold.weight_call(request):
            with self.metrics.operation("update"):
                await self.engine.call(lambda: self._load_weights(body["update_info"]))
        return json_response({"message": "Weights updated"})

    def _load_weights(self, update_info) -> int:
        """Engine thread: receive and load; cached prefixes of the old weights are dropped even when
        loading fails half way (some tensors may already have changed)."""
        try:
            return self.transfer.update(update_info, weight_version=self.engine.weight_version)
        finally:
            self.engine.scheduler.invalidate_prefix_cache()

    async def finish_update(self, request: web.Request) -> web.Response:
        body = await read_body(request, required=False)
        async with self.hold.weight_call(request):
            with self.metrics.operation("finish"):
                self.transfer.finish()
                self._num_updates += 1
                version = body.get("weight_version")
                label = str(version) if version is not None else str(self._num_updates)
                await self.engine.set_weight_version(label)
        return json_response({"message": "Weight update finished"})

    async def shutdown_transfer(self, request: web.Request) -> web.Response:
        async with self.hold.weight_call(request):
            with self.metrics.operation("shutdown"):
                await asyncio.to_thread(self.transfer.shutdown)
        self.hold.leases.release()
        return json_response({"message": "Weight transfer shut down"})

    async def update_weight_version(self, request: web.Request) -> web.Response:
        body = await read_body(request)
        version = body.get("new_version")
        if not isinstance(version, str):
            raise P.ApiError(400, "new_version must be a string", param="new_version")
        await self.engine.set_weight_version(version)
        return json_response({"success": True, "new_version": version})
