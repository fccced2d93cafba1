"""`ServerTransport`: one `aiohttp.ClientSession` to one inference server, the retry mechanism every
request over it goes through, and `wait_until_ready` (poll /health until the server answers).
`GenerationClient` (client.py) builds the server's routes on it and chooses, per call kind, which
failures a request retries:

    retry_transient (default on)    connection errors and 5xx are retried; off: they raise at once
    retry_timeout (default off)     timeouts are retried; off: TimeoutError at once
    4xx is never retried: ServerRequestError at once (or returned, for the call's `pass_statuses`)

Retries are bounded (`max_retries`; connection errors also by `outage_s`, the
`vllm_server_restart_timeout`: a server that a supervisor restarts is waited for that long, polled at
least every OUTAGE_POLL_S), use exponential backoff with jitter, are logged (at most one
line per `RETRY_LOG_INTERVAL_S`, saying how many retries it stands for: hundreds of concurrent
rollouts retry together when the server dies), and call `on_retry()` so the rollout loop can count
`rollout/vllm_retry_count`. Every status is checked. A timeout names the knob to raise,
`vllm_server_timeout`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import aiohttp

from asyncgrpo.generation.protocol import GENERATE_PATH, ProtocolError, error_message

if TYPE_CHECKING:
    from typing_extensions import Self

logger = logging.getLogger(__name__)

_MAX_BACKOFF_S = 30.0
OUTAGE_POLL_S = 5.0  # past max_retries, while waiting for a server to come back
# Idle connections are dropped before vLLM's own 5 s keep-alive (uvicorn, VLLM_HTTP_TIMEOUT_KEEP_ALIVE)
# closes them: a request sent on a connection the server is closing meets "connection reset" and a retry.
# The trainer's control calls (one /pause per step) idle longer than that between uses.
KEEPALIVE_S = 4.0
RETRY_LOG_INTERVAL_S = 10.0
_TRANSPORT_ERRORS = (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError)
_RL_ROUTES = (
    "/pause",
    "/resume",
    "/is_paused",
    "/server_info",
    "/get_world_size",
    "/init_weight_transfer_engine",
    "/start_weight_update",
    "/update_weights",
    "/finish_weight_update",
    "/weight_info",
    "/shutdown_weight_transfer_engine",
    "/weight_checksum",
)

class ServerRequestError(RuntimeError):
    """The server answered a request with an error status (4xx, or 5xx once retries ran out)."""

    def __init__(self, method: str, path: str, status: int, message: str) -> None:
        self.method, self.path, self.status, self.message = method, path, status, message
        hint = ""
        if status == 404 and path.split("?")[0] in _RL_ROUTES:
            hint = " (start vLLM with VLLM_SERVER_DEV_MODE=1 to enable the RL routes)"
        elif status == 403 and path.startswith(GENERATE_PATH):
            hint = " (start vLLM with --enable-scale-out)"
        elif status == 401:
            hint = (" (the server wants an API key: set `vllm_server_api_key`, or the VLLM_API_KEY "
                    "environment variable, to the key given to its --api-key)")
        super().__init__(f"{method} {path} -> HTTP {status}: {message}{hint}")


class ServerConnectionError(ConnectionError):
    """The server could not be reached (after retries where the call allows them)."""


def connection_failure(exc: BaseException) -> str:
    """What went wrong with a connection, in words (aiohttp's reprs nest the socket error deep inside)."""
    if isinstance(exc, aiohttp.ClientConnectorError):
        cause = exc.os_error
        if isinstance(cause, ConnectionRefusedError):
            return "connection refused (nothing listens on the port)"
        return f"cannot connect ({cause.strerror or cause!r})" if isinstance(cause, OSError) else repr(exc)
    if isinstance(exc, aiohttp.ServerDisconnectedError):
        return "the server closed the connection without answering"
    if isinstance(exc, aiohttp.ClientOSError):
        return f"connection error ({exc.strerror or exc!r})"
    return repr(exc)


class _RetryLog:
    """One warning per `interval_s` for a client's retries; a line after a quiet spell says how many
    retries went unshown since the previous line."""

    def __init__(self, interval_s: float = RETRY_LOG_INTERVAL_S) -> None:
        self.interval_s = interval_s
        self._last: float | None = None
        self._unshown = 0

    def warn(self, message: str, *, now_or_never: bool = False) -> None:
        """now_or_never: log it whatever the interval (a change the user must see at once)."""
        now = time.monotonic()
        if not now_or_never and self._last is not None and now - self._last < self.interval_s:
            self._unshown += 1
            return
        if self._unshown:
            message += f" ({self._unshown} more retries not shown in the last {now - self._last:.0f}s)"
        logger.warning("%s", message)
        self._last, self._unshown = now, 0

    def flush(self) -> None:
        """Log the count of retries not shown yet (at close)."""
        if self._unshown:
            logger.warning("%d more retries not shown in the last %.0fs", self._unshown,
                           time.monotonic() - self._last)
            self._unshown = 0


class ServerTransport:
    """The session to the server at `base_url`: `start()` it inside the event loop that will use it,
    `close()` it at the end; `_request` sends one request under the retry policy."""

    def __init__(
        self,
        base_url: str,
        *,
        timeout_s: float,
        api_key: str | None,
        max_retries: int,
        backoff_s: float,
        on_retry: Callable[[], None] | None,
        headers: dict[str, str] | None,
        outage_s: float = 0.0,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        self.max_retries = max_retries
        self.outage_s = outage_s
        self.backoff_s = backoff_s
        self.on_retry = on_retry
        self._headers = {**(headers or {}), **({"Authorization": f"Bearer {api_key}"} if api_key else {})}
        self._session: aiohttp.ClientSession | None = None
        self._rng = random.Random()
        self._retry_log = _RetryLog()
        self._waiting_for_restart = False  # some request is past max_retries, in the restart window

    # ---------------------------------------------------------------------------------- lifecycle

    async def start(self) -> None:
        if self._session is None:
            self._session = aiohttp.ClientSession(
                # concurrency is bounded by the rollout loop
                connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=KEEPALIVE_S),
                headers=self._headers,
                timeout=aiohttp.ClientTimeout(total=None),
            )

    async def close(self) -> None:
        self._retry_log.flush()
        session, self._session = self._session, None
        if session is not None:
            await session.close()

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # ---------------------------------------------------------------------------------- requests

    async def _request(
        self,
        method: str,
        path: str,
        *,
        json_body: Any = None,
        params: dict[str, str] | None = None,
        timeout_s: float | None = None,
        retry_transient: bool = True,
        retry_timeout: bool = False,
        pass_statuses: frozenset[int] = frozenset(),
    ) -> tuple[int, str]:
        """Send one request with the retry policy; return (status, body text) for 2xx/3xx and for
        `pass_statuses`, raise otherwise."""
        if self._session is None:
            raise RuntimeError(f"{type(self).__name__}.start() must be awaited before making requests")
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        url = self.base_url + path
        attempt, started = 0, time.monotonic()
        while True:
            try:
                async with self._session.request(
                    method, url, json=json_body, params=params, timeout=aiohttp.ClientTimeout(total=timeout_s)
                ) as resp:
                    status, text = resp.status, await resp.text()
            except asyncio.TimeoutError as exc:  # also aiohttp's timeout errors
                if not retry_timeout or attempt >= self.max_retries:
                    raise TimeoutError(
                        f"{method} {url} got no answer within {timeout_s:.0f}s"
                        + (f" after {attempt} retries" if attempt else "")
                        + "; raise `vllm_server_timeout` if the server is just slow"
                    ) from exc
                reason = f"no answer within {timeout_s:.0f}s"
            except _TRANSPORT_ERRORS as exc:
                if not retry_transient or self._retries_spent(attempt, started):
                    tried = (f" (after {attempt} retries over {time.monotonic() - started:.0f}s)"
                             if attempt else "")
                    raise ServerConnectionError(
                        f"{method} {url} failed: {connection_failure(exc)}{tried}. The inference server at "
                        f"{self.base_url} does not answer: if it stopped, its log says why; "
                        + self._after_outage()
                    ) from exc
                reason = connection_failure(exc)
            else:
                if status < 400 or status in pass_statuses:
                    if self._waiting_for_restart:
                        self._waiting_for_restart = False
                        logger.warning("the inference server at %s answers again", self.base_url)
                    return status, text
                message = error_message(text)
                # it answers: no outage
                if status < 500 or not retry_transient or attempt >= self.max_retries:
                    raise ServerRequestError(method, path, status, message)
                reason = f"HTTP {status}: {message}"
            attempt += 1
            delay = min(self.backoff_s * 2 ** (attempt - 1), _MAX_BACKOFF_S) * (
                1.0 + 0.5 * self._rng.random()
            )
            if attempt <= self.max_retries:
                self._retry_log.warn(f"{method} {path} failed ({reason}); retry {attempt}/{self.max_retries} "
                                     f"in {delay:.2f}s")
            else:  # the restart window: poll often enough to see the server as soon as it is back
                away = time.monotonic() - started
                delay = max(min(delay, OUTAGE_POLL_S, self.outage_s - away), 0.0)
                self._retry_log.warn(
                    f"{method} {path} failed ({reason}); the server has not answered for {away:.0f}s, "
                    f"waiting up to vllm_server_restart_timeout={self.outage_s:g}s for it to come back",
                    now_or_never=not self._waiting_for_restart,
                )
                self._waiting_for_restart = True
            if self.on_retry is not None:
                self.on_retry()
            await asyncio.sleep(delay)

    def _retries_spent(self, attempt: int, started: float) -> bool:
        """No retry left: `max_retries` done and the restart window (`outage_s`) over."""
        return attempt >= self.max_retries and time.monotonic() - started >= self.outage_s

    def _after_outage(self) -> str:
        """What to do once the server did not come back: the end of a connection error's message."""
        if self.outage_s:
            return (f"it did not come back within vllm_server_restart_timeout={self.outage_s:g}s. Start it "
                    "again and resume training from the last checkpoint")
        return ("start it again and resume training from the last checkpoint, or set "
                "`vllm_server_restart_timeout` to wait for a server that a supervisor restarts")

    @staticmethod
    def _json(path: str, text: str) -> Any:
        try:
            return json.loads(text)
        except ValueError:
            raise ProtocolError(f"{path}: expected JSON, got {text[:300]!r}") from None

    async def _get_json(self, path: str, **kw: Any) -> Any:
        _, text = await self._request("GET", path, **kw)
        return self._json(path, text)

    async def _post_json(self, path: str, body: Any = None, **kw: Any) -> Any:
        _, text = await self._request("POST", path, json_body=body, **kw)
        return self._json(path, text)

    # ---------------------------------------------------------------------------------- readiness

    async def wait_until_ready(self, timeout_s: float) -> None:
        """Poll GET /health until it answers 200; `TimeoutError` naming the URL and the knob after
        `timeout_s`."""
        if self._session is None:
            raise RuntimeError(f"{type(self).__name__}.start() must be awaited before wait_until_ready()")
        deadline = time.monotonic() + timeout_s
        last = "no answer yet"
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(
                    f"generation server at {self.base_url} was not ready after {timeout_s:.0f}s (last "
                    f"/health: {last}); start it (`vllm serve ...` or `asyncgrpo serve MODEL`) or raise "
                    "`vllm_server_timeout`"
                )
            try:
                async with self._session.get(
                    self.base_url + "/health", timeout=aiohttp.ClientTimeout(total=min(5.0, remaining))
                ) as resp:
                    if resp.status == 200:
                        return
                    last = f"HTTP {resp.status}"
            except asyncio.TimeoutError:
                last = "timed out"
            except _TRANSPORT_ERRORS as exc:
                last = type(exc).__name__
            await asyncio.sleep(min(0.5, max(deadline - time.monotonic(), 0.0)))
