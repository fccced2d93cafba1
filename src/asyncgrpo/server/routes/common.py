"""What the route classes share: their route tables, the server's description, request-body and query
parsing, the check that the engine takes new requests, and server-sent-event answers."""

from __future__ import annotations

import json
import os
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, ClassVar

from aiohttp import web

from asyncgrpo.server import protocol as P
from asyncgrpo.server.build import EngineConfig
from asyncgrpo.server.engine import Engine

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
_SSE = {"Content-Type": "text/event-stream; charset=utf-8", "Cache-Control": "no-cache"}


class RouteTable:
    """A route class: `ROUTES` names its (method, path, handler method); `routes()` binds them."""

    ROUTES: ClassVar[tuple[tuple[str, str, str], ...]] = ()

    def routes(self) -> list[tuple[str, str, Handler]]:
        return [(method, path, getattr(self, handler)) for method, path, handler in self.ROUTES]


@dataclass(frozen=True)
class ServerInfo:
    """What the server says about itself (/v1/models, /server_info), fixed at start."""

    model: str  # the model as it was asked for (a card's root)
    name: str  # the served name (--served-model-name, else `model`)
    created: int  # unix time of the start
    seed: int  # of requests that send none
    spec: P.ServerSpec  # what requests are checked against
    engine: EngineConfig


def json_response(data: Any, status: int = 200) -> web.Response:
    return web.json_response(data, status=status)


async def read_body(request: web.Request, required: bool = True) -> dict:
    """The request's JSON object (parsed as JSON only: nothing a client sends is ever unpickled); {} for an
    empty body that is not `required`."""
    text = await request.text()
    if not text.strip() and not required:
        return {}
    try:
        body = json.loads(text)
    except ValueError as exc:  # JSONDecodeError, or an integer of more than 4300 digits
        raise P.ApiError(400, f"the request body is not valid JSON: {exc}") from exc
    except RecursionError:
        raise P.ApiError(400, "the request body nests JSON arrays or objects too deeply") from None
    if not isinstance(body, dict):
        raise P.ApiError(400, "the request body must be a JSON object")
    return body


def query_seconds(request: web.Request, key: str) -> float | None:
    value = request.query.get(key)
    if value is None:
        return None
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if not 0 <= seconds < float("inf"):
        raise ValueError(f"{key} must be a number of seconds >= 0 (0: no expiry), got {value!r}")
    return seconds


def query_bool(request: web.Request, key: str, default: bool) -> bool:
    value = request.query.get(key)
    if value is None:
        return default
    if value.lower() in ("true", "1", "yes"):
        return True
    if value.lower() in ("false", "0", "no"):
        return False
    raise ValueError(f"{key} must be true or false, got {value!r}")


def engine_running(engine: Engine) -> None:
    """500 unless the engine thread runs."""
    if not engine.alive:
        raise P.ApiError(500, "the generation engine is not running; see the server log")


def accepting(engine: Engine) -> None:
    """Whether a generation request may enter: the engine runs and is not paused (keep mode queues)."""
    engine_running(engine)
    if engine.pause_mode in ("abort", "wait"):
        raise P.ApiError(503, P.PAUSED_MESSAGE)


def random_id() -> str:
    """16 hex digits for a request that names none (os.urandom: no UUID object per request)."""
    return os.urandom(8).hex()


class SseStream:
    """A streamed answer (vLLM's framing): `data: <json>` events, then `data: [DONE]`; an error after the
    answer started is a `data:` ErrorResponse and `[DONE]`."""

    def __init__(self, response: web.StreamResponse) -> None:
        self.response = response

    @classmethod
    async def open(cls, request: web.Request) -> SseStream:
        response = web.StreamResponse(status=200, headers=_SSE)
        await response.prepare(request)
        return cls(response)

    async def send(self, data: Any) -> None:
        """One event: `data` as JSON, or a str sent as it is (JSON rendered already, or `[DONE]`)."""
        text = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
        await self.response.write(f"data: {text}\n\n".encode())

    async def fail(self, error: P.ApiError) -> web.StreamResponse:
        await self.send(error.body())
        await self.send("[DONE]")
        return self.response

    async def close(self) -> web.StreamResponse:
        await self.send("[DONE]")
        await self.response.write_eof()
        return self.response
