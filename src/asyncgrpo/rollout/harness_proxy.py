"""`RecordingProxy`: the OpenAI-compatible endpoint harnesses talk to, in front of the inference server.

    harness --POST /h/<key>/v1/chat/completions--> RecordingProxy --forward(path, body, session)--> server
            <-- the reply, as the harness asked for it --          session.calls += what the server sent

Each rollout opens a `ProxySession`: a base URL and an API key of its own (`base_url`, `api_key`), so the
calls of concurrent harnesses never mix. A call is accepted only with the session's key (as a bearer
token) on the session's path, and only while the session is open: a harness still running after its
rollout ended (a timed-out sync harness) gets a 410 and records nothing. What is sent upstream and what
is recorded is `forward`'s business (the rollout loop's); this shell owns the HTTP server, the sessions and
the error replies. It binds 127.0.0.1 on a free port, in the rollout process's event loop. A failure of
`forward` that is not the harness's (the server unreachable, a reply without token ids) answers 502 and
is kept in `session.server_error`, for the rollout to raise once its harness ends: it stops the run as
in any rollout, instead of passing for a harness failure.

Streaming requests (`stream: true`) are streamed: each chunk reaches the harness as the server sends it
(without what it did not ask for), then `[DONE]`; the chunks are recorded as one reply.
"""

from __future__ import annotations

import json
import logging
import secrets
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from asyncgrpo.rollout.harness_calls import ROUTES, HarnessRequestError
from asyncgrpo.types import TurnRecord

logger = logging.getLogger(__name__)

SESSION_PREFIX = "/h"


@dataclass
class RecordedCall:
    """One model call of a harness: its request and reply as the server saw them, and their turns."""

    path: str
    request: dict[str, Any]
    reply: dict[str, Any]
    turns: list[TurnRecord]


@dataclass
class ProxySession:
    """One rollout's endpoint: give `base_url` and `api_key` to its harness; `calls` fill in as it calls."""

    key: str
    base_url: str
    model: str
    context: Any = None  # the rollout's RolloutContext, for `forward`
    calls: list[RecordedCall] = field(default_factory=list)
    open: bool = True
    num_requests: int = 0  # calls received, answered or not (each one's seed differs)
    server_error: BaseException | None = None  # the first failure not the harness's (the run's to raise)

    @property
    def api_key(self) -> str:
        return self.key


Emit = Callable[[dict[str, Any]], Awaitable[None]]
Forward = Callable[[str, dict[str, Any], ProxySession, "Emit | None"], Awaitable[tuple[int, Any]]]


class RecordingProxy:
    """The harnesses' HTTP endpoint. `start()` and `close()` in the event loop that serves it.

    Args:
        forward: `forward(path, body, session, emit) -> (status, reply)`: sends a harness's request on,
            records it into `session` and returns what the harness gets; for a streaming request (`emit`
            given) it awaits `emit(chunk)` per chunk instead and returns (status, None), or a 4xx's reply
            before any chunk. A `HarnessRequestError` becomes a 400.
        model: The model name `/v1/models` lists (harnesses may send any name; `forward` picks the model).
    """

    def __init__(self, forward: Forward, model: str, host: str = "127.0.0.1") -> None:
        self.forward = forward
        self.model = model
        self.host = host
        self._sessions: dict[str, ProxySession] = {}
        self._runner: web.AppRunner | None = None
        self.port: int | None = None

    async def start(self) -> None:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_post(SESSION_PREFIX + "/{key}/v1/{route:.+}", self._post)
        app.router.add_get(SESSION_PREFIX + "/{key}/v1/models", self._models)
        # handler_cancellation: a harness that hangs up (cancelled at its timeout) cancels its call's wait;
        # shutdown_timeout: a sync harness still running after the run must not hold the shutdown
        self._runner = web.AppRunner(app, access_log=None, handler_cancellation=True, shutdown_timeout=5.0)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, 0)
        await site.start()
        self.port = int(self._runner.addresses[0][1])
        logger.info("harness recording proxy listening on http://%s:%d", self.host, self.port)

    async def close(self) -> None:
        runner, self._runner = self._runner, None
        if runner is not None:
            await runner.cleanup()

    def open(self, context: Any = None) -> ProxySession:
        """A new session (a fresh key and base URL) for one rollout."""
        assert self.port is not None, "RecordingProxy.start() must be awaited before open()"
        key = secrets.token_hex(16)
        base_url = f"http://{self.host}:{self.port}{SESSION_PREFIX}/{key}/v1"
        session = ProxySession(key, base_url, self.model, context)
        self._sessions[key] = session
        return session

    def release(self, session: ProxySession) -> None:
        """End `session`: later calls on it are refused (410) and record nothing."""
        session.open = False
        self._sessions.pop(session.key, None)

    # -- HTTP --------------------------------------------------------------------------------------

    def _session(self, request: web.Request) -> ProxySession | web.Response:
        key = request.match_info["key"]
        session = self._sessions.get(key)
        if session is None:
            return _error(410, "this harness session is over: its rollout ended (finished, or stopped after "
                               "harness_timeout); later calls are not recorded", "Gone")
        auth = request.headers.get("Authorization", "")
        if not secrets.compare_digest(auth.encode(), f"Bearer {key}".encode()):
            return _error(401, "wrong API key: use the api_key given with this base_url (OPENAI_API_KEY)",
                          "AuthenticationError")
        return session

    async def _models(self, request: web.Request) -> web.Response:
        session = self._session(request)
        if isinstance(session, web.Response):
            return session
        return web.json_response({"object": "list", "data": [
            {"id": session.model, "object": "model", "created": int(time.time()), "owned_by": "asyncgrpo"}]})

    async def _post(self, request: web.Request) -> web.StreamResponse:
        session = self._session(request)
        if isinstance(session, web.Response):
            return session
        path = "/v1/" + request.match_info["route"]
        if path not in ROUTES:
            return _error(404, f"{path} is not served to harnesses; they may call {', '.join(ROUTES)}",
                          "NotFoundError")
        try:
            body = await request.json()
        except ValueError:
            return _error(400, "the request body is not JSON", "BadRequestError")
        if not isinstance(body, dict):
            return _error(400, "the request body must be a JSON object", "BadRequestError")
        if not body.get("stream"):
            try:
                status, reply = await self.forward(path, body, session, None)
            except HarnessRequestError as exc:
                return _error(400, str(exc), "BadRequestError")
            except Exception as exc:  # noqa: BLE001 -- the server's failure, not the harness's: its rollout raises it
                return self._server_failed(session, exc)
            return web.json_response(reply, status=status)
        return await self._stream(request, path, body, session)

    async def _stream(self, request: web.Request, path: str, body: dict[str, Any],
                      session: ProxySession) -> web.StreamResponse:
        """A streaming call: each chunk goes to the harness as the server sends it, then `[DONE]`."""
        response: web.StreamResponse | None = None

        async def emit(chunk: dict[str, Any]) -> None:
            nonlocal response
            if response is None:
                response = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                                       "Cache-Control": "no-cache"})
                await response.prepare(request)
            await response.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")

        try:
            status, reply = await self.forward(path, body, session, emit)
        except HarnessRequestError as exc:
            if response is None:
                return _error(400, str(exc), "BadRequestError")
            await response.write(b"data: " + json.dumps({"error": {"message": str(exc)}}).encode() + b"\n\n")
            await response.write_eof()
            return response
        except Exception as exc:  # noqa: BLE001 -- the server's failure, not the harness's: its rollout raises it
            if response is None:
                return self._server_failed(session, exc)
            self._server_failed(session, exc)
            error = {"error": {"message": f"the inference server failed: {exc}", "code": 502}}
            await response.write(b"data: " + json.dumps(error).encode() + b"\n\n")
            await response.write_eof()
            return response
        if response is None and status >= 400:
            return web.json_response(reply, status=status)
        if response is None:
            await emit({"choices": []})  # no chunk at all: still a stream
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    @staticmethod
    def _server_failed(session: ProxySession, exc: BaseException) -> web.Response:
        if session.server_error is None:
            session.server_error = exc
        return _error(502, f"the inference server failed: {exc}", "APIError")


def _error(status: int, message: str, kind: str) -> web.Response:
    return web.json_response({"error": {"message": message, "type": kind, "param": None, "code": status}},
                             status=status)
