"""How the generation routes (/inference/v1/generate, /v1/completions, /v1/chat/completions) hand a request
to the engine: its sequences (ids unique over the server, a seed drawn for requests that send none, a
LoRA adapter's slot), the sink that receives their events, and the abort of whatever still runs once the
handler stops waiting (the client went away, a stop string ended every choice, an error).

One instance is shared by the routes: sequence ids key the engine's caches, so they come from one counter.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import random
from collections.abc import AsyncIterator

from asyncgrpo.server import protocol as P
from asyncgrpo.server.engine import Engine, Event
from asyncgrpo.server.lora import Adapter
from asyncgrpo.server.sequence import SeqParams, Sequence


class RequestSink:
    """Loop-side receiver of one request's engine events (`engine.Sink`): `done` resolves when all its
    sequences finished; with `stream` (every step's tokens) every event is also put on `queue`."""

    def __init__(self, num_seqs: int, stream: bool) -> None:
        self.stream = stream
        self.remaining = num_seqs
        self.done = asyncio.get_running_loop().create_future()
        self.queue: asyncio.Queue[Event] = asyncio.Queue()

    def __call__(self, events: list[Event]) -> None:
        for ev in events:
            self.queue.put_nowait(ev)
            if ev[3]:
                self.remaining -= 1
        if self.remaining <= 0 and not self.done.done():
            self.done.set_result(None)


class EngineRequests:
    """The engine as the generation routes use it; `seed` seeds the requests that send no seed."""

    def __init__(self, engine: Engine, spec: P.ServerSpec, seed: int) -> None:
        self.engine = engine
        self.spec = spec
        self._rng = random.Random(seed)
        self._seq_ids = itertools.count()

    def draw_seed(self) -> int:
        return self._rng.getrandbits(63)

    def sequences(self, key: str, prompt: list[int], params: list[SeqParams],
                  adapter: Adapter | None) -> list[Sequence]:
        """One sequence per child (`params`), all under the engine request id `key`."""
        seqs = [Sequence(next(self._seq_ids), key, i, prompt, p, self.spec.max_model_len)
                for i, p in enumerate(params)]
        if adapter is not None:
            for s in seqs:
                s.lora_slot, s.hash_root = adapter.slot, adapter.hash_root
        return seqs

    @contextlib.asynccontextmanager
    async def submitted(self, keys: list[str], seqs: list[Sequence],
                        stream: bool) -> AsyncIterator[RequestSink]:
        """Submit `seqs` (engine request ids `keys`); on leaving, whatever has not finished is aborted."""
        sink = RequestSink(len(seqs), stream)
        self.engine.submit(seqs, sink)
        try:
            yield sink
        finally:
            if not sink.done.done():
                self.engine.abort_nowait(keys)

    async def run(self, keys: list[str], seqs: list[Sequence]) -> None:
        """Generate `seqs` to their end; 500 with the first sequence's error."""
        async with self.submitted(keys, seqs, stream=False) as sink:
            await sink.done
        raise_errors(seqs)


def raise_errors(seqs: list[Sequence]) -> None:
    errors = [s.error for s in seqs if s.error]
    if errors:
        raise P.ApiError(500, errors[0])
