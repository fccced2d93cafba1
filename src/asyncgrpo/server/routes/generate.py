"""Generation routes: POST /v1/completions (text or token prompts, several per request) and
/inference/v1/generate (token ids in, token ids out, streamed as server-sent events or not).

Every handler validates (`protocol.py`), hands the request's sequences to the engine thread, awaits their
events and serialises the answer (`responses.py`). A request that names a LoRA adapter in `model` holds
its slot until it ends; a client that goes away aborts its sequences.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import random
import time
from typing import Any

from aiohttp import web

from asyncgrpo.server import protocol as P
from asyncgrpo.server import responses as R
from asyncgrpo.server.engine import Engine
from asyncgrpo.server.lora import Adapter
from asyncgrpo.server.routes.common import RouteTable, ServerInfo, accepting, json_response, read_body
from asyncgrpo.server.routes.models import ModelNames
from asyncgrpo.server.routes.text import TextCodec
from asyncgrpo.server.sequence import Sequence

_SSE = {"Content-Type": "text/event-stream; charset=utf-8", "Cache-Control": "no-cache"}


def _random_id() -> str:
    """16 hex digits for a request that names none (os.urandom: no UUID object per request)."""
    return os.urandom(8).hex()


def _sse(data: Any) -> bytes:
    text = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    return f"data: {text}\n\n".encode()


class _Sink:
    """Loop-side receiver of one request's engine events (`engine.Sink`): `done` resolves when all
    its sequences finished; a streaming request also reads every event from `queue`."""

    def __init__(self, num_seqs: int, stream: bool) -> None:
        self.stream = stream
        self.remaining = num_seqs
        self.done = asyncio.get_running_loop().create_future()
        self.queue: asyncio.Queue | None = asyncio.Queue() if stream else None

    def __call__(self, events) -> None:
        for ev in events:
            if self.queue is not None:
                self.queue.put_nowait(ev)
            if ev[3]:
                self.remaining -= 1
        if self.remaining <= 0 and not self.done.done():
            self.done.set_result(None)


class GenerateRoutes(RouteTable):
    """The generation routes over the engine; `info.seed` seeds the requests that send no seed."""

    ROUTES = (("POST", "/v1/completions", "completions"), ("POST", "/inference/v1/generate", "generate"))

    def __init__(self, engine: Engine, info: ServerInfo, names: ModelNames, text: TextCodec) -> None:
        self.engine = engine
        self.info = info
        self.spec = info.spec
        self.names = names
        self.text = text
        self._rng = random.Random(info.seed)
        self._seq_ids = itertools.count()

    def _draw_seed(self) -> int:
        return self._rng.getrandbits(63)

    def _sequences(self, key: str, prompt: list[int], params, adapter: Adapter | None) -> list[Sequence]:
        seqs = [Sequence(next(self._seq_ids), key, i, prompt, p, self.spec.max_model_len)
                for i, p in enumerate(params)]
        if adapter is not None:
            for s in seqs:
                s.lora_slot, s.hash_root = adapter.slot, adapter.hash_root
        return seqs

    async def _run(self, key: str, seqs: list[Sequence]) -> None:
        sink = _Sink(len(seqs), stream=False)
        self.engine.submit(seqs, sink)
        try:
            await sink.done
        except asyncio.CancelledError:
            self.engine.abort_nowait([key])
            raise
        errors = [s.error for s in seqs if s.error]
        if errors:
            raise P.ApiError(500, errors[0])

    # ---- /inference/v1/generate -------------------------------------------------------------------
    async def generate(self, request: web.Request) -> web.StreamResponse:
        accepting(self.engine)
        body = await read_body(request)
        adapter = self.names.resolve(body.get("model"))
        with self.names.in_use(adapter):
            return await self._generate(request, body, adapter)

    async def _generate(self, request: web.Request, body: dict,
                        adapter: Adapter | None) -> web.StreamResponse:
        if body.get("output_mode", "tokens") not in (None, "tokens"):
            raise P.ApiError(400, "output_mode must be 'tokens' on the embedded server", param="output_mode")
        prompt = P.token_id_list(body.get("token_ids"), self.spec, "token_ids")
        P.check_text_only(body, [prompt], self.spec, "token_ids")
        params = P.parse_sampling(body.get("sampling_params") or {}, self.spec, len(prompt), route="generate",
                                  draw_seed=self._draw_seed)
        rid = request.headers.get("X-Request-Id") or body.get("request_id") or _random_id()
        key = f"generate-tokens-{rid}"
        seqs = self._sequences(key, prompt, params, adapter)
        return_ids = bool(body.get("return_token_ids", False))
        include_usage = P.stream_include_usage(body)
        if body.get("stream"):
            return await self._stream(request, key, prompt, seqs, return_ids, include_usage)
        await self._run(key, seqs)
        model = self.info.name if adapter is None else adapter.name
        text = R.generate_response(key, model, int(time.time()), prompt, seqs, return_ids)
        return web.Response(text=text, content_type="application/json")

    async def _stream(
        self, request: web.Request, key: str, prompt: list[int], seqs: list[Sequence], return_ids: bool,
        usage: bool,
    ) -> web.StreamResponse:
        sink = _Sink(len(seqs), stream=True)
        self.engine.submit(seqs, sink)
        resp = web.StreamResponse(status=200, headers=_SSE)
        finished = 0
        try:
            await resp.prepare(request)
            first = True
            while finished < len(seqs):
                seq, start, end, final = await sink.queue.get()
                finished += int(final)
                if seq.error:
                    self.engine.abort_nowait([key])
                    await resp.write(_sse(P.error_body(seq.error, "InternalServerError", 500)))
                    await resp.write(_sse("[DONE]"))
                    return resp
                chunk: dict[str, Any] = {"request_id": key, "usage": None, "output_mode": "tokens"}
                if first and return_ids:
                    chunk["prompt_token_ids"] = prompt
                rendered = R.Rendered()
                chunk["choices"] = [R.generate_choice(seq, start, end, final, rendered)]
                first = False
                await resp.write(_sse(rendered.dumps(chunk)))
            if usage:
                completion = sum(len(s.output) for s in seqs)
                tail = {"request_id": key, "usage": R.usage(len(prompt), completion, details=False),
                        "output_mode": "tokens", "choices": []}
                await resp.write(_sse(tail))
            await resp.write(_sse("[DONE]"))
            await resp.write_eof()
        except (asyncio.CancelledError, ConnectionResetError):
            if finished < len(seqs):
                self.engine.abort_nowait([key])
            raise
        return resp

    # ---- /v1/completions --------------------------------------------------------------------------
    async def completions(self, request: web.Request) -> web.Response:
        accepting(self.engine)
        body = await read_body(request)
        adapter = self.names.resolve(body.get("model"))
        with self.names.in_use(adapter):
            return await self._completions(request, body, adapter)

    async def _completions(self, request: web.Request, body: dict, adapter: Adapter | None) -> web.Response:
        for key, bad in (("stream", True), ("echo", True), ("suffix", None), ("prompt_logprobs", None)):
            if body.get(key) not in (None, False) and (bad is True or body.get(key) is not None):
                raise P.ApiError(400, f"{key} is not supported on /v1/completions by the embedded server",
                                 param=key)
        P.stream_include_usage(body)  # validated like vLLM even though streaming is not offered here
        prompts = self.text.prompts(body.get("prompt"))
        P.check_text_only(body, prompts, self.spec, "prompt")
        rid = body.get("request_id") or request.headers.get("X-Request-Id") or _random_id()
        all_seqs = []
        for i, prompt in enumerate(prompts):
            params = P.parse_sampling(body, self.spec, len(prompt), route="completions",
                                      draw_seed=self._draw_seed)
            all_seqs.append(self._sequences(f"cmpl-{rid}-{i}", prompt, params, adapter))
        await asyncio.gather(*(self._run(seqs[0].request_key, seqs) for seqs in all_seqs))
        tok = self.text.tokenizer
        texts = [[tok.decode(s.output, skip_special_tokens=True) if tok else "" for s in seqs]
                 for seqs in all_seqs]
        as_ids = bool(body.get("return_tokens_as_token_ids", False)) or tok is None

        def decode(t: int) -> str:
            return tok.decode([t])

        lps = [
            [R.completion_logprobs(s, decode, as_ids) if s.params.logprobs is not None else None
             for s in seqs]
            for seqs in all_seqs
        ]
        out = R.completion_response(
            f"cmpl-{rid}", self.info.name if adapter is None else adapter.name, int(time.time()), prompts,
            all_seqs, texts, lps,
            bool(body.get("return_token_ids", False)), bool(body.get("return_weight_versions", False)),
        )
        return json_response(out)
