"""Fake `ServerLink`s for `ServerLinks`: they run the real pause and resume code against fake clients,
each on a thread of its own (as a `ServerLink` runs it on its own event loop), and note what happened;
no request is made."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

from asyncgrpo.generation.transport import ServerConnectionError
from asyncgrpo.train.server_link import ServerLinks

PAUSE_S = 0.3


class FakeClient:
    """`fails`: "pause" or "resume" fail (connection refused), "all" both (a dead server), None neither."""

    def __init__(self, url: str, events: list[str], fails: str | None) -> None:
        self.url, self.events, self.fails = url, events, fails

    async def pause(self, mode: str, clear_cache: bool) -> None:
        await asyncio.sleep(PAUSE_S)
        if self.fails in ("pause", "all"):
            raise ServerConnectionError(f"POST {self.url}/pause failed: connection refused")
        self.events.append(f"pause {self.url}")

    async def resume(self) -> None:
        if self.fails in ("resume", "all"):
            raise ServerConnectionError(f"POST {self.url}/resume failed: connection refused")
        self.events.append(f"resume {self.url}")


class FakeLink:
    """What `ServerLinks` uses of a `ServerLink`: its URL, client, pause setting and loop."""

    def __init__(self, url: str, events: list[str], fails: str | None = None) -> None:
        self.base_url, self.keep_kv, self.held = url, False, False
        self.client = FakeClient(url, events, fails)
        self._thread = ThreadPoolExecutor(1)

    def submit(self, coro):
        return self._thread.submit(asyncio.run, coro)

    def wait(self, future, timeout_s=None):
        return future.result(timeout=10)

    def answers(self, timeout_s: float = 2.0) -> bool:
        return self.client.fails != "all"


def links(*fails: str | None) -> tuple[ServerLinks, list[str]]:
    events: list[str] = []
    return ServerLinks([FakeLink(f"http://s{i}:8000", events, f) for i, f in enumerate(fails)]), events
