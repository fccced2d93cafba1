"""The trainer's connection to the inference server: detection, the trainer lease, and the pause
around a weight push.

The HTTP client (and the weight transports' senders, which use it) are asyncio objects; the trainer is
synchronous. `ServerLink` owns one event loop on a daemon thread and runs every call there with a
timeout, so the training loop never blocks on a dead server for longer than `timeout_s`.

One weight sync (DESIGN section 7), whatever the transport (`asyncgrpo.train.weights`):

    while_paused:  pause(mode=keep) -> the transport's push coroutine -> resume
    a failure anywhere leaves the server resumed and raises with what happened

At start (`connect`): a server held by another live trainer is refused (embedded server); a server
left paused (its trainer died mid-sync) is resumed, with a warning. Against the embedded server the
link then renews its trainer lease every few seconds (`asyncgrpo.server.lease`), so that its pause
and its weight-transfer group outlive it by at most the server's `--trainer-lease`; `close()` gives
the server back at once (the next trainer, e.g. the next run of a script, starts without waiting).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid
from collections.abc import Callable, Coroutine
from typing import Any

from asyncgrpo.generation.client import GenerationClient, ServerRestartedError
from asyncgrpo.generation.protocol import INITIAL_WEIGHT_VERSION, TRAINER_HEADER, ProtocolError
from asyncgrpo.generation.transport import ServerConnectionError, ServerRequestError
from asyncgrpo.train.waiting import notice_while_waiting

logger = logging.getLogger(__name__)


class ServerLink:
    def __init__(self, base_url: str, *, timeout_s: float, api_key: str | None = None, keep_kv: bool = False,
                 restart_timeout_s: float = 0.0) -> None:
        """keep_kv: a sync's pause keeps the KV cache of the requests in flight (`keep_kv_across_syncs`).
        restart_timeout_s: `vllm_server_restart_timeout`, how long a call waits for a server that stopped
        answering (a pause before a push waits for it to come back; the push then finds it restarted)."""
        self.base_url = base_url
        self.timeout_s = timeout_s
        self.keep_kv = keep_kv
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="asyncgrpo-server-link", daemon=True
        )
        self._thread.start()
        self.trainer_id = uuid.uuid4().hex[:12]
        self.client = GenerationClient(
            base_url, timeout_s=timeout_s, api_key=api_key, headers={TRAINER_HEADER: self.trainer_id},
            outage_s=restart_timeout_s,
        )
        self.info = None
        self._renewal: asyncio.Task | None = None
        self._leased = False  # the server has a trainer lease (the embedded server): release it at close
        self._pushes = 0  # weight pushes done: after one, a server back at its initial weights restarted
        self._run(self.client.start())

    def _run(self, coro: Coroutine, timeout_s: float | None = None) -> Any:
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return future.result(timeout=timeout_s or self.timeout_s)
        except TimeoutError:
            if future.done():  # the coroutine's own TimeoutError (e.g. wait_until_ready's, naming /health)
                raise
            future.cancel()
            raise TimeoutError(
                f"the inference server at {self.base_url} did not answer within "
                f"{timeout_s or self.timeout_s:.0f}s; check that it is running and healthy, or raise "
                "`vllm_server_timeout`"
            ) from None

    def connect(self) -> Any:
        """Wait for the server (bounded by `vllm_server_timeout`, saying so within seconds and every
        minute) and detect its features."""
        with notice_while_waiting(lambda waited: (
            f"waiting for the inference server at {self.base_url} ({waited:.0f} s so far; giving up after "
            f"vllm_server_timeout={self.timeout_s:g} s): start it (`asyncgrpo serve MODEL` or `vllm serve "
            "MODEL`) or fix vllm_server_base_url"
        )):
            self._run(self.client.wait_until_ready(self.timeout_s), timeout_s=self.timeout_s + 5)
        self._run(self._take_over())  # before detect(): its probe request would wait on a paused server
        self.info = self._run(self.client.detect())
        return self.info

    async def _take_over(self) -> None:
        """Refuse a server held by another live trainer; resume a server left paused; start renewing."""
        lease = await self.client.lease()  # None: not the embedded server
        if lease is not None and lease.get("message"):
            raise RuntimeError(f"cannot train against {self.base_url}: {lease['message']}")
        self._leased = lease is not None
        try:
            paused = await self.client.is_paused()
        except ServerRequestError as exc:
            if exc.status != 404:
                raise
            paused = False  # vLLM without VLLM_SERVER_DEV_MODE: detect() says what that means
        if paused:
            logger.warning(
                "the inference server at %s was paused, most likely left so by a trainer that stopped "
                "during a "
                "weight sync; resuming it", self.base_url,
            )
            await self.client.resume()
        if lease is not None and lease["lease_s"] > 0:
            self._renewal = asyncio.ensure_future(self._renew_forever(float(lease["lease_s"])))

    async def _renew_forever(self, lease_s: float) -> None:
        interval = min(5.0, lease_s / 3)
        while True:
            await asyncio.sleep(interval)
            try:
                await self.client.renew_lease(timeout_s=interval)
            except (ServerConnectionError, ServerRequestError, ProtocolError, TimeoutError) as exc:
                # the next sync reports a server that is really gone; one missed renewal is not fatal
                logger.debug("renewing the trainer lease failed: %s", exc)

    def run(self, coro: Coroutine, timeout_s: float | None = None) -> Any:
        """Run a coroutine of this link's client on its loop (bounded by `timeout_s`)."""
        return self._run(coro, timeout_s)

    def is_open(self) -> bool:
        """Whether calls can still run (`close()` not yet called)."""
        return self._thread.is_alive()

    def while_paused(self, push: Callable[[], Coroutine]) -> dict[str, float]:
        """Pause (keep; dropping the KV of requests in flight unless `keep_kv`), run the coroutine `push()`
        returns on the link's loop, resume; the push returns at least `bytes` and `num_chunks` (and
        `delta` where a transport may send one, passed on). A failure leaves the server resumed and
        raises; a server that restarted since the last push (its weight-transfer group gone with it) is
        `ServerRestartedError`."""
        t0 = time.perf_counter()
        self._run(self.client.pause(mode="keep", clear_cache=not self.keep_kv))
        t_paused = time.perf_counter()
        try:
            pushed = self._run(push())
        except BaseException as exc:
            self._resume_after_failure()
            if isinstance(exc, Exception) and self.restarted():
                raise ServerRestartedError(self.base_url, "failed a weight push and serves weights no "
                                                          "trainer "
                                           "pushed") from exc
            raise
        self._pushes += 1
        t_pushed = time.perf_counter()
        self._run(self.client.resume())
        t_done = time.perf_counter()
        return {
            "pause_s": t_paused - t0,
            "transfer_s": t_pushed - t_paused,
            "resume_s": t_done - t_pushed,
            "total_s": t_done - t0,
            "bytes": pushed["bytes"],
            "num_chunks": pushed["num_chunks"],
            **({"delta": pushed["delta"]} if "delta" in pushed else {}),  # a delta push, or a full one
        }

    def restarted(self) -> bool:
        """Whether the server serves its initial weights although this link pushed weights into it: it
        restarted, and lost them and the weight-transfer group (False when it cannot tell)."""
        if not self._pushes:
            return False
        try:
            return (
                self._run(self.client.weight_info(), timeout_s=30 + self.client.outage_s)
                == INITIAL_WEIGHT_VERSION
            )
        except Exception:  # noqa: BLE001 -- unknown: whatever failed is reported by its own call
            return False

    def _resume_after_failure(self) -> None:
        try:
            self._run(self.client.resume(), timeout_s=30)
        except Exception as exc:  # noqa: BLE001 -- the push error is the one to report; log this one
            logger.error("resuming the server after a failed weight sync also failed: %s", exc)

    async def _release(self) -> None:
        """Drop this trainer's hold on the embedded server (and the server's end of its weight-transfer
        group) so that the next trainer need not wait out the lease; a server already gone is fine."""
        try:
            await self.client.release_hold()
        except (ServerConnectionError, ServerRequestError, ProtocolError, TimeoutError) as exc:
            logger.warning("could not give the inference server at %s back (%s); the next trainer may wait "
                           "up to "
                           "its --trainer-lease", self.base_url, exc)

    def close(self) -> None:
        """Stop renewing, give the server back, close the client (idempotent). The weight transport, which
        runs on this link's loop, is closed first."""
        if not self._thread.is_alive():  # closed already
            return

        async def _close() -> None:
            if self._renewal is not None:
                self._renewal.cancel()
            if self._leased:
                await self._release()
            await self.client.close()

        try:
            self._run(_close(), timeout_s=30)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=5)
