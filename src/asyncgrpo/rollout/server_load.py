"""The rollout process's view of the inference servers: per server a client, a KV cap and the rollouts in
flight; the choice of a group's server; the `/metrics` poller.

    ServerLoads (one per rollout process), one ServerLoad per URL of `vllm_server_base_url`:
      dispatcher, a group starts -> start_group(n): concurrency.choose_server(caps, in flight), the
                                    server with the most free capacity; the group's rollouts (every
                                    turn, tools included) stay on it, so its prompt is cached there once
      first request to a server  -> connect(i): GenerationClient started, ready, described; its
                                    ConcurrencyCap from the server's KV-cache size
      admission gate             -> cap(): the servers' caps summed, within max_concurrent_rollouts
      poll_forever (SERVER_POLL_S) -> every connected server's /metrics: its cap follows its KV-cache
                                    usage; rollout/vllm_* combined over the servers (`combined_load`),
                                    rollout/concurrency*, and with several servers a split per server
      a request finds its server gone -> fail_over(i): the server is out (cap 0, a WARNING names it),
                                    the request goes to the server with the most free capacity, and
                                    its rollout's later turns with it
      poll_forever, for an out server -> back in once its /health answers and it serves the weights the
                                    trainer pushed last (/weight_info: the trainer pushes them first)

The clients are created on first use: a custom `generate_one_turn` may never call a server. With one
server this is the single-server behaviour and metrics exactly (no split is logged, nothing fails over:
the last server that answers is never left out).
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from asyncgrpo import metrics as M
from asyncgrpo.generation.client import GenerationClient
from asyncgrpo.generation.protocol import ProtocolError
from asyncgrpo.generation.server_info import ServerInfo
from asyncgrpo.generation.transport import ServerConnectionError, ServerRequestError
from asyncgrpo.rollout.concurrency import ConcurrencyCap, choose_server
from asyncgrpo.types import WeightVersion

logger = logging.getLogger(__name__)

SERVER_POLL_S = 5.0


@dataclass(frozen=True)
class LoadReading:
    """One server's `/metrics` at one poll; the counters as increments since its previous poll (None: the
    server does not export it, or this is its first poll)."""

    kv_cache_usage_frac: float | None
    num_requests_running: float | None
    num_requests_waiting: float | None
    new_preemptions: float | None = None
    new_prefix_queries: float | None = None  # prompt tokens looked up in the prefix cache
    new_prefix_hits: float | None = None  # of those, tokens found cached


def combined_load(readings: Sequence[LoadReading]) -> list[tuple[str, float]]:
    """The rollout/vllm_* records of one poll of every server (pure): requests running and waiting and the
    preemptions summed (as vLLM sums its engines), the KV-cache usage averaged over the servers that
    report it, the prefix-cache hit fraction over all servers' lookups. NaN for a gauge no server reports;
    a counter without increments is left out."""
    def present(values: list[float | None]) -> list[float]:
        return [v for v in values if v is not None]

    kv = present([r.kv_cache_usage_frac for r in readings])
    running = present([r.num_requests_running for r in readings])
    waiting = present([r.num_requests_waiting for r in readings])
    records = [
        (M.ROLLOUT_VLLM_KV_CACHE_USAGE_FRAC, sum(kv) / len(kv) if kv else math.nan),
        (M.ROLLOUT_VLLM_RUNNING_REQUESTS, sum(running) if running else math.nan),
        (M.ROLLOUT_VLLM_QUEUED_REQUESTS, sum(waiting) if waiting else math.nan),
    ]
    preemptions = present([r.new_preemptions for r in readings])
    if preemptions:
        records.append((M.ROLLOUT_VLLM_PREEMPTION_COUNT, sum(preemptions)))
    looked_up = [(r.new_prefix_queries, r.new_prefix_hits) for r in readings
                 if r.new_prefix_queries and r.new_prefix_hits is not None and r.new_prefix_queries > 0]
    if looked_up:
        records.append((M.ROLLOUT_VLLM_PREFIX_CACHE_HIT_FRAC,
                        sum(h for _, h in looked_up) / sum(q for q, _ in looked_up)))
    return records


class ServerLoad:
    """One inference server as the rollout process sees it: its generation client, its concurrency cap
    that follows the server's load, and the rollouts in flight on it.

    Args:
        base_url, timeout_s, restart_timeout_s, api_key: one URL of `vllm_server_base_url`,
            `vllm_server_timeout`, `vllm_server_restart_timeout`, `vllm_server_api_key`.
        max_concurrent_rollouts: The user's upper bound of the cap.
        record: Where (name, value) metrics go.
        expects_pushed_weights: A trainer pushed its weights before the rollouts started: tokens from the
            server's initial weights (it restarted) are dropped and asked again once it serves pushed
            weights (`GenerationClient.generate`).
    """

    def __init__(
        self,
        *,
        base_url: str,
        timeout_s: float,
        restart_timeout_s: float = 0.0,
        api_key: str | None,
        max_concurrent_rollouts: int,
        record: Callable[[str, float], None],
        expects_pushed_weights: bool = False,
    ) -> None:
        self.base_url = base_url
        self.expects_pushed_weights = expects_pushed_weights
        self.timeout_s = timeout_s
        self.restart_timeout_s = restart_timeout_s
        self.api_key = api_key
        self.max_concurrent_rollouts = max_concurrent_rollouts
        self.record = record
        self.client: GenerationClient | None = None
        self.info: ServerInfo | None = None
        self.in_flight = 0  # rollouts of the groups sent here that have not finished
        self.out = False  # it stopped answering: no request goes here until it is back (ServerLoads)
        self._kv_cap: ConcurrencyCap | None = None
        self._lock = asyncio.Lock()  # binds to the event loop at first use (Python >= 3.10)
        self._warned_candidates = False
        self._last_preemptions: float | None = None  # the counters at the previous poll
        self._last_prefix: tuple[float, float] | None = None

    async def connect(self) -> tuple[GenerationClient, ServerInfo]:
        """The client and what the server serves, created on the first call (concurrent callers wait)."""
        if self.client is not None and self.info is not None:
            return self.client, self.info
        async with self._lock:
            if self.info is None:
                client = GenerationClient(
                    self.base_url,
                    timeout_s=self.timeout_s,
                    api_key=self.api_key,
                    outage_s=self.restart_timeout_s,
                    on_retry=lambda: self.record(M.ROLLOUT_VLLM_RETRY_COUNT, 1),
                )
                client.expects_pushed_weights = self.expects_pushed_weights
                self.client = client
                await client.start()
                await client.wait_until_ready(self.timeout_s)
                info = await client.detect()
                self._kv_cap = ConcurrencyCap(
                    self.max_concurrent_rollouts,
                    kv_cache_tokens=info.kv_cache_tokens if info.has_metrics else None,
                    max_model_len=info.max_model_len,
                )
                self.info = info
        return self.client, self.info

    def cap(self) -> int:
        """How many rollouts may be in flight here: the KV cap (once connected) within
        max_concurrent_rollouts; 0 while it is out."""
        if self.out:
            return 0
        cap = self.max_concurrent_rollouts
        if self._kv_cap is not None:
            cap = min(cap, int(self._kv_cap.cap))
        return max(cap, 1)

    def on_rollout_finished(self) -> None:
        self.in_flight -= 1
        if self._kv_cap is not None:
            self._kv_cap.on_rollout_finished()

    def wants_candidates(self, sampling_is_truncated: bool, settings: str) -> bool:
        """Whether to ask for each token's candidate set: when sampling is truncated and the server can
        return them (warned once otherwise; `settings` names the truncating knobs)."""
        if not sampling_is_truncated:
            return False
        assert self.info is not None, "connect() first"
        if self.info.supports_sampling_mask:
            return True
        if not self._warned_candidates:
            self._warned_candidates = True
            logger.warning(
                "%s truncate sampling, but the server at %s cannot return the candidate sets (needs vLLM >= "
                "0.28 with --return-sampling-mask --enable-scale-out): the trainer normalises over the full "
                "vocabulary and importance ratios are biased",
                settings, self.base_url,
            )
        return False

    @property
    def polled(self) -> bool:
        """Connected to a server that serves /metrics, and not out."""
        return self.client is not None and self.info is not None and self.info.has_metrics and not self.out

    async def poll(self) -> LoadReading | None:
        """Read the server's /metrics once and move the cap by its KV-cache usage (None: no /metrics)."""
        assert self.client is not None and self._kv_cap is not None, "connect() first"
        snapshot = await self.client.metrics()
        if snapshot is None:
            return None
        new_preemptions = new_queries = new_hits = None
        if snapshot.num_preemptions is not None:
            if self._last_preemptions is not None:
                new_preemptions = max(snapshot.num_preemptions - self._last_preemptions, 0)
            self._last_preemptions = snapshot.num_preemptions
        if snapshot.prefix_cache_queries is not None and snapshot.prefix_cache_hits is not None:
            prefix = (snapshot.prefix_cache_queries, snapshot.prefix_cache_hits)
            if self._last_prefix is not None:
                new_queries, new_hits = prefix[0] - self._last_prefix[0], prefix[1] - self._last_prefix[1]
            self._last_prefix = prefix
        if snapshot.kv_cache_usage_frac is not None:
            self._kv_cap.on_server_load(snapshot.kv_cache_usage_frac, int(snapshot.num_requests_waiting or 0))
        return LoadReading(snapshot.kv_cache_usage_frac, snapshot.num_requests_running,
                           snapshot.num_requests_waiting, new_preemptions, new_queries, new_hits)

    async def close(self) -> None:
        if self.client is not None:
            await asyncio.wait_for(self.client.close(), timeout=10.0)


class ServerLoads:
    """Every server of the run (`vllm_server_base_url`, in its order), one `ServerLoad` each; a group's
    server is chosen when it starts (module docstring). Arguments: `ServerLoad`'s, with `base_urls` the
    list of servers."""

    def __init__(
        self,
        base_urls: Sequence[str],
        *,
        timeout_s: float,
        restart_timeout_s: float = 0.0,
        api_key: str | None,
        max_concurrent_rollouts: int,
        record: Callable[[str, float], None],
        expects_pushed_weights: bool = False,
    ) -> None:
        assert base_urls, "at least one server (the config refuses an empty list)"
        self.max_concurrent_rollouts = max_concurrent_rollouts
        self.record = record
        self.loads = [
            ServerLoad(base_url=url, timeout_s=timeout_s, restart_timeout_s=restart_timeout_s,
                       api_key=api_key, max_concurrent_rollouts=max_concurrent_rollouts, record=record,
                       expects_pushed_weights=expects_pushed_weights)
            for url in base_urls
        ]

    def __len__(self) -> int:
        return len(self.loads)

    def set_expects_pushed_weights(self, expects: bool) -> None:
        for load in self.loads:
            load.expects_pushed_weights = expects

    def cap(self) -> int:
        """How many rollouts may be in flight on all servers together, within max_concurrent_rollouts."""
        return min(sum(load.cap() for load in self.loads), self.max_concurrent_rollouts)

    def choose(self) -> int:
        """The server with the most free capacity now (`concurrency.choose_server`)."""
        index = choose_server([load.cap() for load in self.loads], [load.in_flight for load in self.loads])
        assert index is not None, "every server has a cap of at least 1"
        return index

    def start_group(self, num_rollouts: int) -> int:
        """Choose the server of a group of `num_rollouts` that starts now and count them in flight there;
        returns its index."""
        index = self.choose()
        self.loads[index].in_flight += num_rollouts
        return index

    def on_rollout_finished(self, index: int) -> None:
        self.loads[index].on_rollout_finished()

    async def connect(self, index: int) -> tuple[GenerationClient, ServerInfo]:
        """Server `index`'s client and description (connected on first use)."""
        load = self.loads[index]
        if load.info is not None:
            return load.client, load.info
        connected = await load.connect()
        self.record(M.ROLLOUT_CONCURRENCY_CAP, self.cap())
        return connected

    def wants_candidates(self, index: int, sampling_is_truncated: bool, settings: str) -> bool:
        return self.loads[index].wants_candidates(sampling_is_truncated, settings)

    def record_concurrency(self, in_flight: int) -> None:
        """rollout/concurrency and rollout/concurrency_cap, and with several servers each one's share."""
        self.record(M.ROLLOUT_CONCURRENCY, in_flight)
        self.record(M.ROLLOUT_CONCURRENCY_CAP, self.cap())
        if len(self.loads) > 1:
            for i, load in enumerate(self.loads):
                self.record(M.per_server(M.ROLLOUT_CONCURRENCY, i), load.in_flight)
                self.record(M.per_server(M.ROLLOUT_CONCURRENCY_CAP, i), load.cap())

    def fail_over(self, index: int, exc: BaseException) -> int | None:
        """A request to server `index` found it gone (`exc`): the server is out (a WARNING names it, once)
        and the request's rollout moves, counted in flight, to the server with the most free capacity,
        whose index is returned. None when no other server answers: the caller raises `exc`."""
        if not self._leave_out(index, exc):
            return None
        target = self.choose()
        self.loads[index].in_flight -= 1
        self.loads[target].in_flight += 1
        return target

    def _leave_out(self, index: int, exc: BaseException) -> bool:
        """Take server `index` out of the choice (a WARNING names it, once); False when no other server
        answers (it stays in: the caller raises)."""
        load = self.loads[index]
        if not any(other.cap() > 0 for i, other in enumerate(self.loads) if i != index):
            return False
        if not load.out:
            load.out = True
            logger.warning(
                "the inference server at %s does not answer (%s): its requests go to the other servers; it "
                "takes rollouts again once its /health answers and it serves the trainer's weights",
                load.base_url, str(exc).split(". ")[0],
            )
        return True

    async def _rejoin(self, version: int) -> None:
        """Each out server whose /health answers and that serves the trainer's weights is back in: the
        weights of `version` (the trainer pushes them to a server that comes back first), or of the next
        one (a sync pushes them to every server before it publishes the version)."""
        labels = (WeightVersion(version).label(), WeightVersion(version).next().label())
        for load in self.loads:
            if not load.out or load.client is None:
                continue
            try:
                if not await load.client.answers():
                    continue
                serves = await load.client.weight_info()
            except (TimeoutError, ServerConnectionError, ServerRequestError, ProtocolError):
                continue
            if serves in labels:
                load.out = False
                logger.warning("the inference server at %s answers again and serves the trainer's weights "
                               "(%s): it takes rollouts again", load.base_url, serves)

    async def poll_forever(self, in_flight: Callable[[], int], model_version: Callable[[], int]) -> None:
        """Every SERVER_POLL_S: each connected server's load (its cap moves with its KV-cache usage) and
        the combined rollout/vllm_* metrics, the servers read at once; an out server back once it serves
        the weights of `model_version()` (the version the trainer published last)."""
        while True:
            await asyncio.sleep(SERVER_POLL_S)
            await self._rejoin(model_version())
            polled = [(i, load) for i, load in enumerate(self.loads) if load.polled]
            readings = await asyncio.gather(*(load.poll() for _, load in polled), return_exceptions=True)
            for (i, _), reading in zip(polled, readings):
                if isinstance(reading, BaseException):
                    if not (isinstance(reading, ServerConnectionError) and self._leave_out(i, reading)):
                        raise reading
            present = [(i, r) for (i, _), r in zip(polled, readings)
                       if r is not None and not isinstance(r, BaseException)]
            if present:
                for name, value in combined_load([r for _, r in present]):
                    self.record(name, value)
                if len(self.loads) > 1:
                    for i, reading in present:
                        self.record(M.per_server(M.ROLLOUT_VLLM_KV_CACHE_USAGE_FRAC, i),
                                    _nan(reading.kv_cache_usage_frac))
            self.record_concurrency(in_flight())

    async def close(self) -> None:
        """Close every client (all of them, whichever fails); raises the first failure."""
        results = await asyncio.gather(*(load.close() for load in self.loads), return_exceptions=True)
        failed = [r for r in results if isinstance(r, BaseException)]
        if failed:
            raise failed[0]


def _nan(value: float | None) -> float:
    return math.nan if value is None else float(value)
