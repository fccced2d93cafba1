"""The trainer's hold on the embedded server (`lease.py`): one trainer holds it at a time, and nothing it
leaves behind (a pause, a half-finished weight update) outlives it. Embedded-server extensions (vLLM has
none):

    GET  /lease        {"lease_s", "holder", "holder_alive", "is_holder", "seconds_left", "is_paused",
                        "message"}
    POST /renew_lease  {"renewed", "lease_s", "is_paused"}    (the trainer, every lease_s / 3)

`TrainerHold` is what the weight and control routes check (the holder of a weight-transfer group) and
the watchdog that resumes a pause whose lease ran out.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

from aiohttp import web

from asyncgrpo.server import protocol as P
from asyncgrpo.server.engine import Engine
from asyncgrpo.server.lease import TRAINER_HEADER, Leases
from asyncgrpo.server.routes.common import RouteTable
from asyncgrpo.server.weights import WeightTransfer

logger = logging.getLogger(__name__)

WATCH_INTERVAL_S = 1.0


def trainer_id(request: web.Request) -> str | None:
    return request.headers.get(TRAINER_HEADER) or None


class TrainerHold:
    """The lease, the weight transfer it guards and the engine it pauses (loop side)."""

    def __init__(self, leases: Leases, transfer: WeightTransfer, engine: Engine) -> None:
        self.leases = leases
        self.transfer = transfer
        self.engine = engine

    def held_message(self) -> str:
        left = self.leases.seconds_left()
        return (
            f"the weight transfer group of this server is already initialised by another trainer: "
            f"{self.leases.describe_holder()}. Two trainers cannot share one server (each would overwrite "
            f"the other's weights): stop the other trainer, or start a second server for this one (asyncgrpo "
            f"serve MODEL --port N). If the other trainer is gone, its hold runs out within {left:.0f} s: "
            f"start again then"
        )

    async def holder_alive(self) -> bool:
        """The lease says so, and (gloo) the holder's TCPStore still accepts connections: a killed
        trainer's store is gone at once, so its successor need not wait for the lease to run out."""
        if not self.leases.holder_alive():
            return False
        address = self.transfer.store_address()
        if address is None:
            return True
        try:
            _, writer = await asyncio.wait_for(asyncio.open_connection(*address), timeout=1.0)
        except (OSError, asyncio.TimeoutError):
            return False
        writer.close()
        return True

    async def admit_init(self, request: web.Request) -> None:
        """Before a weight-transfer init: refuse it (409) while another live trainer holds the server;
        take over from a holder that is gone, abandoning what it left half done."""
        leases = self.leases
        if leases.holder is None or leases.is_holder(trainer_id(request)):
            return
        if await self.holder_alive():
            raise P.ApiError(409, self.held_message())
        logger.warning("taking the weight transfer over from %s, which stopped renewing its lease",
                       leases.describe_holder())
        await self.abandon_transfer()

    @contextlib.asynccontextmanager
    async def weight_call(self, request: web.Request) -> AsyncIterator[None]:
        """Around start/update/finish: only the holder (or anyone, once it is gone) may call them, and
        the call itself renews the lease and keeps it from running out while it runs."""
        tid = trainer_id(request)
        if self.leases.holder is not None and not self.leases.is_holder(tid) and await self.holder_alive():
            raise P.ApiError(409, self.held_message())
        self.leases.busy += 1
        self.leases.renew(tid)
        try:
            yield
        finally:
            self.leases.busy -= 1
            self.leases.renew(tid)

    async def abandon_transfer(self) -> None:
        """Drop the group and an unfinished update (the served weights then mix two versions until the
        next full push: the version says so)."""
        active = self.transfer.active
        await asyncio.to_thread(self.transfer.abandon)
        self.leases.release()
        if active:
            version = f"{self.engine.weight_version}+partial"
            logger.warning("abandoned a weight update left unfinished: some tensors may hold the new "
                           "weights; the served weights are labelled %r until the next trainer pushes a full "
                           "update", version)
            await self.engine.set_weight_version(version)

    async def watch(self) -> None:
        """Loop task: resume a pause whose lease ran out (abandoning an unfinished update first)."""
        while True:
            await asyncio.sleep(WATCH_INTERVAL_S)
            if self.engine.pause_mode is None:
                continue
            self.leases.book_pause()  # a pause whose request never booked it still ends with a lease
            if not self.leases.pause_expired():
                continue
            logger.warning(
                "the pause lease ran out: nobody renewed it for %.0f s (the trainer that paused the server "
                "is gone?); resuming generation", self.leases.pause_lease_s,
            )
            if self.transfer.active:
                await self.abandon_transfer()
            await self.engine.resume()
            self.leases.resumed()


class LeaseRoutes(RouteTable):
    """GET /lease, POST /renew_lease."""

    ROUTES = (("GET", "/lease", "lease"), ("POST", "/renew_lease", "renew_lease"))

    def __init__(self, hold: TrainerHold) -> None:
        self.hold = hold

    async def lease(self, request: web.Request) -> web.Response:
        leases = self.hold.leases
        alive = await self.hold.holder_alive()
        held_by_other = alive and not leases.is_holder(trainer_id(request))
        return web.json_response({
            "lease_s": leases.lease_s,
            "holder": leases.describe_holder() if leases.holder else None,
            "holder_alive": alive,
            "is_holder": leases.is_holder(trainer_id(request)),
            "seconds_left": leases.seconds_left(),
            "is_paused": self.hold.engine.pause_mode is not None,
            "message": self.hold.held_message() if held_by_other else None,
        })

    async def renew_lease(self, request: web.Request) -> web.Response:
        leases = self.hold.leases
        renewed = leases.renew(trainer_id(request))
        return web.json_response({"renewed": renewed, "lease_s": leases.lease_s,
                                  "is_paused": self.hold.engine.pause_mode is not None})
