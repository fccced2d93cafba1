"""The trainer's connection to the inference servers: detection, the trainer lease, and the pause
around a weight push. `ServerLink` is one server; `ServerLinks` every server of `vllm_server_base_url`.

The HTTP client (and the weight transports' senders, which use it) are asyncio objects; the trainer is
synchronous. `ServerLink` owns one event loop on a daemon thread and runs every call there with a
timeout, so the training loop never blocks on a dead server for longer than `timeout_s`.

One weight sync (DESIGN section 7), whatever the transport (`asyncgrpo.train.weights`):

    while_paused:  pause(mode=keep) -> the transport's push coroutine -> resume
    a failure anywhere leaves the server resumed and raises with what happened

With several servers (`ServerLinks.paused`), every server is paused before the first push and resumed
after the last:

    paused():   pause(mode=keep) on every server at once (each link's own loop)
                  one fails -> resume the ones paused, raise naming the server
                inside, each server's transport pushes; its link's while_paused only pushes (held)
                resume on every server at once, the push's failure included

At start (`connect`): a server held by another live trainer is refused (embedded server); a server
left paused (its trainer died mid-sync) is resumed, with a warning. Against the embedded server the
link then renews its trainer lease every few seconds (`asyncgrpo.server.lease`), so that its pause
and its weight-transfer group outlive it by at most the server's `--trainer-lease`; `close()` gives
the server back at once (the next trainer, e.g. the next run of a script, starts without waiting).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
import uuid
from collections.abc import Callable, Coroutine, Iterator, Sequence
from contextlib import contextmanager
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
        # paused by `ServerLinks.paused` with the other servers: while_paused pushes only, they resume it
        self.held = False
        self._run(self.client.start())

    def _run(self, coro: Coroutine, timeout_s: float | None = None) -> Any:
        return self.wait(self.submit(coro), timeout_s)

    def submit(self, coro: Coroutine) -> concurrent.futures.Future:
        """Start a coroutine of this link's client on its loop; `wait` for it (several links' at once)."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def wait(self, future: concurrent.futures.Future, timeout_s: float | None = None) -> Any:
        """The result of what `submit` started, within `timeout_s` (default `vllm_server_timeout`)."""
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

    def answers(self, timeout_s: float = 2.0) -> bool:
        """Whether the server's /health answers 200 within `timeout_s` (one attempt)."""
        return self._run(self.client.answers(timeout_s), timeout_s=timeout_s + 5)

    def is_open(self) -> bool:
        """Whether calls can still run (`close()` not yet called)."""
        return self._thread.is_alive()

    async def pause(self) -> float:
        """Pause the server for a push (keep; dropping the KV of requests in flight unless `keep_kv`);
        returns the seconds it took. A coroutine: run it with `run`, or `submit` it beside other links'."""
        t0 = time.perf_counter()
        await self.client.pause(mode="keep", clear_cache=not self.keep_kv)
        return time.perf_counter() - t0

    async def resume(self) -> float:
        """Resume the server after a push; returns the seconds it took (a coroutine, as `pause`)."""
        t0 = time.perf_counter()
        await self.client.resume()
        return time.perf_counter() - t0

    def while_paused(self, push: Callable[[], Coroutine]) -> dict[str, float]:
        """Pause (keep; dropping the KV of requests in flight unless `keep_kv`), run the coroutine `push()`
        returns on the link's loop, resume; the push returns at least `bytes` and `num_chunks` (and
        `delta` where a transport may send one, passed on). A failure leaves the server resumed and
        raises; a server that restarted since the last push (its weight-transfer group gone with it) is
        `ServerRestartedError`."""
        t0 = time.perf_counter()
        if self.held:  # ServerLinks.paused paused it with the other servers, and resumes it: push only
            return self._push_held(push, t0)
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

    def _push_held(self, push: Callable[[], Coroutine], t0: float) -> dict[str, float]:
        """`while_paused`'s push into a server `ServerLinks.paused` holds paused: no pause or resume here
        (pause_s and resume_s are 0); what the push returns is passed on."""
        try:
            pushed = self._run(push())
        except Exception as exc:
            if self.restarted():
                raise ServerRestartedError(self.base_url, "failed a weight push and serves weights no "
                                                          "trainer pushed") from exc
            raise
        self._pushes += 1
        transfer_s = time.perf_counter() - t0
        return {**{k: v for k, v in pushed.items() if k != "transfer_s"},
                "pause_s": 0.0, "transfer_s": transfer_s, "resume_s": 0.0, "total_s": transfer_s}

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


def same_model_problem(base_urls: Sequence[str], infos: Sequence[Any]) -> str | None:
    """What keeps these servers from serving one run (pure), or None: each is listed once (an embedded
    server's instance id is the same through every address), and every one must serve the same model
    with the same max_model_len (the trainer pushes one set of weights to all, and the packing budget and
    the prompts' room come from that length)."""
    seen: dict[str, str] = {}  # instance id -> the first URL that reached it
    for url, info in zip(base_urls, infos):
        instance = info.device.instance_id if info.device is not None else None
        if instance is not None and instance in seen:
            return (f"{seen[instance]} and {url} reach the same inference server: list each server of "
                    "vllm_server_base_url once (through a second address the trainer would push the same "
                    "weights into it twice, and the server refuses a second weight transfer group)")
        if instance is not None:
            seen[instance] = url
    first_url, first = base_urls[0], infos[0]
    for url, info in zip(base_urls[1:], infos[1:]):
        if info.model_name != first.model_name:
            return (f"the inference servers at {first_url} and {url} serve different models "
                    f"({first.model_name!r} and {info.model_name!r}): every server of vllm_server_base_url "
                    "must serve the model being trained")
        if info.max_model_len != first.max_model_len:
            return (f"the inference servers at {first_url} and {url} have different max_model_len "
                    f"({first.max_model_len} and {info.max_model_len}): start them with the same "
                    "--max-model-len")
    return None


class ServerLinks:
    """The trainer's links to every server of `vllm_server_base_url`, in its order (`open` makes one
    `ServerLink` each), connected one after the other, paused together."""

    def __init__(self, links: Sequence[ServerLink]) -> None:
        assert links, "at least one server (the config refuses an empty list)"
        self.links = list(links)

    @classmethod
    def open(cls, base_urls: Sequence[str], **link_kwargs: Any) -> ServerLinks:
        """A link to each URL (`link_kwargs`: `ServerLink`'s keyword arguments); none is left open when one
        cannot be made."""
        links: list[ServerLink] = []
        try:
            for url in base_urls:
                links.append(ServerLink(url, **link_kwargs))
        except BaseException:
            for link in links:
                link.close()
            raise
        return cls(links)

    def __len__(self) -> int:
        return len(self.links)

    def __iter__(self) -> Iterator[ServerLink]:
        return iter(self.links)

    def connect(self) -> list[Any]:
        """Wait for every server and detect it (`ServerLink.connect`); raises `ValueError` when they do not
        serve the same model (`same_model_problem`). Returns their `ServerInfo`s, in order."""
        infos = [link.connect() for link in self.links]
        problem = same_model_problem([link.base_url for link in self.links], infos)
        if problem is not None:
            raise ValueError(problem)
        return infos

    @contextmanager
    def paused(self, indices: Sequence[int] | None = None, *,
               spare_unreachable: bool = False) -> Iterator[dict[str, Any]]:
        """The servers `indices` (default: all) paused at once for a push, and resumed at once after it (a
        failed push included). Inside, their links are `held`: their `while_paused` only pushes. Yields a
        dict that holds, on exit, each server's `pause_s` and `resume_s` ({index: seconds}), and
        `unreachable` ({index: error}).

        A server that fails to pause: the ones already paused are resumed, then `RuntimeError` names it.
        A server that fails to resume after a push that went through: `RuntimeError` names it, after every
        other server was resumed. With `spare_unreachable`, a server that cannot be reached
        (`ServerConnectionError`) while another can is not an error: it goes into `unreachable` and is
        neither held nor resumed; the caller adds a server its push could not reach to `unreachable`."""
        indices = list(range(len(self.links))) if indices is None else list(indices)
        timings: dict[str, Any] = {"unreachable": {}}
        pause_s, lost = self._on_every_server("pause", ServerLink.pause, indices, spare_unreachable)
        timings["unreachable"].update(lost)
        paused = [i for i in indices if i not in lost]
        for i in paused:
            self.links[i].held = True
        try:
            yield timings
        except BaseException:
            self._release(paused)
            try:
                self._on_every_server("resume", ServerLink.resume,
                                      [i for i in paused if i not in timings["unreachable"]], False)
            except RuntimeError as exc:  # the push's error is the one to report; log this one
                logger.error("%s", exc)
            raise
        self._release(paused)
        resume_s, lost = self._on_every_server(
            "resume", ServerLink.resume, [i for i in paused if i not in timings["unreachable"]],
            spare_unreachable)
        timings["unreachable"].update(lost)
        timings["pause_s"], timings["resume_s"] = pause_s, resume_s

    def _release(self, indices: Sequence[int]) -> None:
        for i in indices:
            self.links[i].held = False

    def _on_every_server(self, what: str, call: Callable[[ServerLink], Coroutine], indices: Sequence[int],
                         spare_unreachable: bool) -> tuple[dict[int, float], dict[int, BaseException]]:
        """Run `call(link)` (pause or resume) on the links `indices`, each on its own loop, at once: the
        seconds each took, and (`spare_unreachable`) the ones that could not be reached while others
        could. Otherwise a pause that fails resumes the links it paused before raising; a resume that
        fails raises once all ran."""
        futures = {i: self.links[i].submit(call(self.links[i])) for i in indices}
        seconds: dict[int, float] = {}
        failures: dict[int, BaseException] = {}
        for i, future in futures.items():
            try:
                seconds[i] = self.links[i].wait(future)
            except Exception as exc:  # noqa: BLE001 -- every link is waited for; the failures are raised below
                failures[i] = exc
        unreachable = all(isinstance(e, ServerConnectionError) for e in failures.values())
        if spare_unreachable and seconds and unreachable:  # some answered: the others are left out
            return seconds, failures
        if not failures:
            return seconds, {}
        # name the failure that is an error: with spare_unreachable, one that is not a lost connection
        index, exc = next(((i, e) for i, e in failures.items()
                           if not (spare_unreachable and isinstance(e, ServerConnectionError))),
                          next(iter(failures.items())))
        if what == "pause" and seconds:
            try:
                self._on_every_server("resume", ServerLink.resume, list(seconds), False)
            except RuntimeError as resume_exc:
                logger.error("%s", resume_exc)
        others = (f"; the {len(seconds)} other server(s) paused were resumed" if what == "pause" and seconds
                  else "")
        raise RuntimeError(
            f"could not {what} the inference server at {self.links[index].base_url} around a weight push: "
            f"{exc}{others}"
        ) from exc

    def close(self) -> None:
        """Close every link (each gives its server back); the first failure is raised after all ran."""
        failure: BaseException | None = None
        for link in self.links:
            try:
                link.close()
            except Exception as exc:  # noqa: BLE001 -- close them all, then raise the first
                failure = failure or exc
        if failure is not None:
            raise failure
