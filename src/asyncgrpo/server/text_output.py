"""The text of a generated sequence on the OpenAI routes (/v1/completions, /v1/chat/completions), as its
tokens arrive: incremental detokenization, stop strings, and what a stream may send yet.

vLLM's rules (vllm-protocol.md section 3.1): a stop token (EOS, another EOS id of the generation config,
a `stop_token_ids` id) ends the sequence and is kept in `token_ids`, but its text is not output. A stop
string ends it too: the text stops before the string (`include_stop_str_in_output` keeps it) and the
tokens up to the one that completed the string are kept; the engine knows nothing of stop strings, the
route aborts what runs on. While streaming, the last len(longest stop string) - 1 characters and an
incomplete UTF-8 character are held back until the next tokens say what they are.

Pure: a decode function (token ids -> text) in, strings out; the routes own the engine and the HTTP side.
Incremental decoding (windows of a few tokens, as vLLM's detokenizer) gives the text of decoding every
token at once for byte-level tokenizers; `incremental=False` decodes once at the end (non-streaming
requests without stop strings, the fast path).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

Decode = Callable[[list[int]], str]
_INCOMPLETE = "\ufffd"  # what a decoder writes for a UTF-8 character whose bytes have not all arrived


class TextOutput:
    """One sequence's output text; feed it the output tokens in order (`add`), read `delta`."""

    def __init__(self, decode: Decode, stop_ids: frozenset[int], stop: tuple[str, ...] = (),
                 include_stop_str: bool = False, incremental: bool = True) -> None:
        """decode: token ids -> text; stop_ids: the ids that end the sequence (their text is not output);
        stop: stop strings (need `incremental`); include_stop_str: keep the stop string in the text."""
        assert incremental or not stop, "stop strings are found token by token"
        self._decode = decode
        self._stop_ids = stop_ids
        self._stop = stop
        self._include = include_stop_str
        self._incremental = incremental
        self._hold = max((len(s) for s in stop), default=1) - 1
        self._ids: list[int] = []  # the tokens whose text is output
        self._prefix = 0  # decode window: text of _ids[_prefix:_read] is known, _ids[_read:] is new
        self._read = 0
        self.num_tokens = 0  # output tokens taken (the kept ones: none after a stop string)
        self.text = ""  # the text so far, cut at a stop string
        self.stop_string: str | None = None  # the stop string that ended the text
        self._sent = 0  # characters handed out by `delta`
        self._closed = False

    @property
    def stopped(self) -> bool:
        """A stop string ended the text: later tokens are not taken."""
        return self.stop_string is not None

    def add(self, tokens: Iterable[int]) -> None:
        """Take new output tokens in order, up to the one that completes a stop string."""
        for token in tokens:
            if self.stopped:
                return
            self.num_tokens += 1
            if token in self._stop_ids:  # sampled only where it ends the sequence (banned before min_tokens)
                continue
            self._ids.append(token)
            if self._incremental:
                before = len(self.text)
                self.text += self._next_text(final=False)
                self._find_stop(before)

    def finish(self) -> str:
        """The whole text, once the sequence ended (whatever was held back included)."""
        if not self._closed:
            self._closed = True
            if not self._incremental:
                self.text = self._decode(self._ids)
            elif not self.stopped:
                before = len(self.text)
                self.text += self._next_text(final=True)
                self._find_stop(before)
        return self.text

    def delta(self, final: bool = False) -> str:
        """The text not handed out yet that a stream may send now (all of it when `final` or stopped)."""
        if final:
            self.finish()
        end = len(self.text) if final or self.stopped else len(self.text) - self._hold
        if end <= self._sent:
            return ""
        out, self._sent = self.text[self._sent:end], end
        return out

    def _next_text(self, final: bool) -> str:
        """The text the tokens after the window add (vLLM's incremental detokenization): the window's
        tokens decode the new ones in context (a tokenizer may write a token differently at the start)."""
        known = self._decode(self._ids[self._prefix:self._read])
        text = self._decode(self._ids[self._prefix:])
        if len(text) > len(known) and (final or not text.endswith(_INCOMPLETE)):
            self._prefix, self._read = self._read, len(self._ids)
            return text[len(known):]
        return ""

    def _find_stop(self, before: int) -> None:
        """Cut the text at the earliest stop string that the characters from `before` on complete."""
        found = None
        for stop in self._stop:
            at = self.text.find(stop, max(0, before - len(stop) + 1))
            if at >= 0 and (found is None or at < found[0]):
                found = (at, stop)
        if found is not None:
            at, self.stop_string = found
            self.text = self.text[: at + len(self.stop_string) if self._include else at]
