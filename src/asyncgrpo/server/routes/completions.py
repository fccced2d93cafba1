"""POST /v1/completions: OpenAI text completions (a string, strings, token ids or lists of them; `n` choices
per prompt), answered whole or streamed as server-sent events, in vLLM 0.33's shapes.

    body --protocol.parse_sampling (route "completions")--> sequences, one engine request per prompt
         --EngineRequests.submitted--> events --choices.follow (text, stop strings)--> body or chunks

Streaming (`stream: true`): per engine step one chunk per choice with its new text (`text_completion`
objects, every key present), the finish reason on the choice's last, a usage chunk with
`stream_options.include_usage`, then `data: [DONE]`; an engine error mid-stream is a `data:` ErrorResponse
and `[DONE]`. Choice i of prompt p has index p * n + i.
"""

from __future__ import annotations

import time
from typing import Any

from aiohttp import web

from asyncgrpo.server import protocol as P
from asyncgrpo.server import responses as R
from asyncgrpo.server.lora import Adapter
from asyncgrpo.server.routes.choices import Choice, follow
from asyncgrpo.server.routes.common import (
    RouteTable,
    ServerInfo,
    SseStream,
    accepting,
    json_response,
    random_id,
    read_body,
)
from asyncgrpo.server.routes.engine_requests import EngineRequests, RequestSink
from asyncgrpo.server.routes.models import ModelNames
from asyncgrpo.server.routes.text import TextCodec

_REFUSED = (("echo", True), ("suffix", None), ("prompt_logprobs", None))  # (field, any value refused?)


class CompletionRoutes(RouteTable):
    """/v1/completions over the engine, with the served model's tokenizer for text."""

    ROUTES = (("POST", "/v1/completions", "completions"),)

    def __init__(self, requests: EngineRequests, info: ServerInfo, names: ModelNames,
                 text: TextCodec) -> None:
        self.requests = requests
        self.info = info
        self.spec = info.spec
        self.names = names
        self.text = text

    async def completions(self, request: web.Request) -> web.StreamResponse:
        accepting(self.requests.engine)
        body = await read_body(request)
        adapter = self.names.resolve(body.get("model"))
        with self.names.in_use(adapter):
            return await self._completions(request, body, adapter)

    async def _completions(self, request: web.Request, body: dict,
                           adapter: Adapter | None) -> web.StreamResponse:
        for key, any_value in _REFUSED:
            if body.get(key) not in (None, False) and (any_value is True or body.get(key) is not None):
                raise P.ApiError(400, f"{key} is not supported on /v1/completions by the embedded server",
                                 param=key)
        include_usage = P.stream_include_usage(body)
        stop = P.stop_strings(body)
        tok = self.text.tokenizer
        if stop and tok is None:
            raise P.ApiError(400, "stop strings need the model's tokenizer, which this model has none of; "
                                  "use stop_token_ids", param="stop")
        prompts = self.text.prompts(body.get("prompt"))
        P.check_text_only(body, prompts, self.spec, "prompt")
        rid = body.get("request_id") or request.headers.get("X-Request-Id") or random_id()
        sampling = {k: v for k, v in body.items() if k != "stop"}
        keys, seqs = [], []
        for i, prompt in enumerate(prompts):
            params = P.parse_sampling(sampling, self.spec, len(prompt), route="completions",
                                      draw_seed=self.requests.draw_seed)
            keys.append(f"cmpl-{rid}-{i}")
            seqs += self.requests.sequences(keys[-1], prompt, params, adapter)
        stream = bool(body.get("stream"))
        skip_special = bool(body.get("skip_special_tokens", True))

        def decode(ids: list[int]) -> str:
            return tok.decode(ids, skip_special_tokens=skip_special) if tok is not None else ""

        include_stop = bool(body.get("include_stop_str_in_output", False))
        choices = [Choice(i, s, decode, stop, include_stop, stream or bool(stop)) for i, s in enumerate(seqs)]
        reply = _Reply(f"cmpl-{rid}", self.info.name if adapter is None else adapter.name, body, tok)
        async with self.requests.submitted(keys, seqs, stream=stream or bool(stop)) as sink:
            if stream:
                num_prompt = sum(len(p) for p in prompts)
                return await self._stream(request, reply, choices, sink, include_usage, num_prompt)
            async for _ in follow(sink, choices):
                pass
        out = R.completion_response(
            reply.id, reply.model, reply.created, [reply.choice(c) for c in choices],
            sum(len(p) for p in prompts), sum(c.num_tokens for c in choices))
        return json_response(out)

    async def _stream(self, request: web.Request, reply: _Reply, choices: list[Choice], sink: RequestSink,
                      include_usage: bool, num_prompt_tokens: int) -> web.StreamResponse:
        stream = await SseStream.open(request)
        try:
            async for choice, start in follow(sink, choices):
                choice_chunk = reply.stream_choice(choice, start)
                await stream.send(R.completion_chunk(reply.id, reply.model, reply.created, [choice_chunk]))
        except P.ApiError as exc:
            return await stream.fail(exc)
        if include_usage:
            tail = R.usage(num_prompt_tokens, sum(c.num_tokens for c in choices), details=False)
            await stream.send(R.completion_chunk(reply.id, reply.model, reply.created, [], tail))
        return await stream.close()


class _Reply:
    """What the choices of one request share in the answer: ids, names, the fields asked for."""

    def __init__(self, request_id: str, model: str, body: dict[str, Any], tokenizer: Any) -> None:
        self.id = request_id
        self.model = model
        self.created = int(time.time())
        self.token_ids = bool(body.get("return_token_ids", False))
        self.versions = bool(body.get("return_weight_versions", False))
        self.as_ids = bool(body.get("return_tokens_as_token_ids", False)) or tokenizer is None
        self.tokenizer = tokenizer
        self._offsets: dict[int, int] = {}  # characters of the log-prob tokens each choice has sent

    def _token(self, t: int) -> str:
        return self.tokenizer.decode([t])

    def choice(self, c: Choice) -> dict[str, Any]:
        seq, n = c.seq, c.num_tokens
        lps = None
        if seq.params.logprobs is not None:
            lps = R.completion_logprobs(seq, self._token, self.as_ids, 0, n)
        return R.completion_choice(
            c.index, c.text.finish(), lps, c.finish, c.token_ids if self.token_ids else None,
            seq.prompt if self.token_ids else None, R.weight_versions(seq, n) if self.versions else None)

    def stream_choice(self, c: Choice, start: int) -> dict[str, Any]:
        seq, end = c.seq, c.num_tokens
        lps = None
        if seq.params.logprobs is not None:
            offset = self._offsets.get(c.index, 0)
            lps = R.completion_logprobs(seq, self._token, self.as_ids, start, end, offset)
            self._offsets[c.index] = offset + sum(map(len, lps["tokens"]))
        return R.stream_choice(
            c.index, c.text.delta(final=c.finished), lps, c.finish if c.finished else None,
            seq.output[start:end] if self.token_ids else None,
            seq.prompt if self.token_ids and start == 0 else None)
