"""The choices of an OpenAI response (/v1/completions, /v1/chat/completions) as their sequences' events
arrive: each choice's tokens and text (`text_output.TextOutput`: stop tokens' text left out, stop strings),
its finish reason, and the loop over a request's events that both routes stream or collect from.

A choice ends when its sequence does or when a stop string completes; the sequences that run on past a
stop string are aborted when the route leaves `EngineRequests.submitted` (tokens they make meanwhile are
not taken).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable

from asyncgrpo.server import protocol as P
from asyncgrpo.server.routes.engine_requests import RequestSink
from asyncgrpo.server.sequence import Sequence
from asyncgrpo.server.text_output import TextOutput


class Choice:
    """One choice: its index in the response, its sequence, its text."""

    def __init__(self, index: int, seq: Sequence, decode: Callable[[list[int]], str], stop: tuple[str, ...],
                 include_stop_str: bool, incremental: bool) -> None:
        self.index = index
        self.seq = seq
        self.text = TextOutput(decode, seq.params.stop_ids, stop, include_stop_str, incremental)
        self.finished = False

    @property
    def num_tokens(self) -> int:
        """Output tokens of the choice (a stop string's last token included, later ones not)."""
        return self.text.num_tokens

    @property
    def token_ids(self) -> list[int]:
        return self.seq.output[: self.num_tokens]

    @property
    def finish(self) -> tuple[str | None, int | str | None]:
        """(finish_reason, stop_reason): a stop string's, or the sequence's."""
        if self.text.stopped:
            return "stop", self.text.stop_string
        return self.seq.finish_reason, self.seq.stop_reason


async def follow(sink: RequestSink, choices: list[Choice]) -> AsyncIterator[tuple[Choice, int]]:
    """Per event of a choice that has not ended: (the choice, the index of its first new token); its new
    tokens are [start, choice.num_tokens) and `choice.finished` says whether it ended. Returns once every
    choice ended.

    Raises:
        ApiError: 500 with a sequence's error (the engine failed it).
    """
    by_seq = {id(c.seq): c for c in choices}
    live = len(choices)
    while live:
        seq, _, end, final = await sink.queue.get()
        choice = by_seq[id(seq)]
        if choice.finished:  # a stop string ended it; the sequence ran on until the abort
            continue
        if seq.error:
            raise P.ApiError(500, seq.error)
        start = choice.num_tokens
        choice.text.add(seq.output[start:end])
        if final or choice.text.stopped:
            choice.finished = True
            choice.text.finish()
            live -= 1
        yield choice, start
