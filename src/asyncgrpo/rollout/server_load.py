"""The rollout process's view of the inference server: its client, the `/metrics` poller and the KV cap.

    first generate_one_turn --connect()--> GenerationClient: start, wait until ready, detect
                                           ConcurrencyCap from the server's KV-cache size
    poll_forever (every SERVER_POLL_S) --> rollout/vllm_* metrics; the cap follows KV-cache usage
    the loop's dispatcher --------------->  cap(): how many rollouts may be in flight

The client is created on first use: a custom `generate_one_turn` may never call the server.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Callable

from asyncgrpo import metrics as M
from asyncgrpo.generation.client import GenerationClient
from asyncgrpo.generation.server_info import ServerInfo
from asyncgrpo.rollout.concurrency import ConcurrencyCap

logger = logging.getLogger(__name__)

SERVER_POLL_S = 5.0


class ServerLoad:
    """One generation client per rollout process, and the concurrency cap that follows the server's load.

    Args:
        base_url, timeout_s, restart_timeout_s, api_key: `vllm_server_base_url`, `vllm_server_timeout`,
            `vllm_server_restart_timeout`, `vllm_server_api_key`.
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
        self._kv_cap: ConcurrencyCap | None = None
        self._lock = asyncio.Lock()  # binds to the event loop at first use (Python >= 3.10)
        self._warned_candidates = False

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
                self.record(M.ROLLOUT_CONCURRENCY_CAP, self.cap())
        return self.client, self.info

    def cap(self) -> int:
        """How many rollouts may be in flight: the KV cap (once connected) within max_concurrent_rollouts."""
        cap = self.max_concurrent_rollouts
        if self._kv_cap is not None:
            cap = min(cap, int(self._kv_cap.cap))
        return max(cap, 1)

    def on_rollout_finished(self) -> None:
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

    async def poll_forever(self, in_flight: Callable[[], int]) -> None:
        """Every SERVER_POLL_S: the server's load metrics, and the cap moved by its KV-cache usage."""
        assert self.client is not None and self._kv_cap is not None, "connect() first"
        last_preemptions: float | None = None
        last_prefix: tuple[float, float] | None = None
        while True:
            await asyncio.sleep(SERVER_POLL_S)
            snapshot = await self.client.metrics()
            if snapshot is None:
                continue
            self.record(M.ROLLOUT_VLLM_KV_CACHE_USAGE_FRAC, _nan(snapshot.kv_cache_usage_frac))
            self.record(M.ROLLOUT_VLLM_RUNNING_REQUESTS, _nan(snapshot.num_requests_running))
            self.record(M.ROLLOUT_VLLM_QUEUED_REQUESTS, _nan(snapshot.num_requests_waiting))
            if snapshot.num_preemptions is not None:
                if last_preemptions is not None:
                    self.record(M.ROLLOUT_VLLM_PREEMPTION_COUNT,
                                max(snapshot.num_preemptions - last_preemptions, 0))
                last_preemptions = snapshot.num_preemptions
            if snapshot.prefix_cache_queries is not None and snapshot.prefix_cache_hits is not None:
                prefix = (snapshot.prefix_cache_queries, snapshot.prefix_cache_hits)
                if last_prefix is not None and prefix[0] > last_prefix[0]:
                    hit_frac = (prefix[1] - last_prefix[1]) / (prefix[0] - last_prefix[0])
                    self.record(M.ROLLOUT_VLLM_PREFIX_CACHE_HIT_FRAC, hit_frac)
                last_prefix = prefix
            if snapshot.kv_cache_usage_frac is not None:
                self._kv_cap.on_server_load(snapshot.kv_cache_usage_frac,
                                            int(snapshot.num_requests_waiting or 0))
            self.record(M.ROLLOUT_CONCURRENCY, in_flight())
            self.record(M.ROLLOUT_CONCURRENCY_CAP, self.cap())

    async def close(self) -> None:
        if self.client is not None:
            await asyncio.wait_for(self.client.close(), timeout=10.0)


def _nan(value: float | None) -> float:
    return math.nan if value is None else float(value)
