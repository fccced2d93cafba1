"""POST /inference/v1/generate: token ids in, token ids out (vLLM's scale-out route), answered whole or
streamed as server-sent events.

The handler validates (`protocol.py`), hands the request's sequences to the engine thread
(`EngineRequests`), awaits their events and serialises the answer (`responses.py`). A request that names
a LoRA adapter in `model` holds its slot until it ends; a client that goes away aborts its sequences.
"""

from __future__ import annotations

import time
from typing import Any

from aiohttp import web

from asyncgrpo.server import protocol as P
from asyncgrpo.server import responses as R
from asyncgrpo.server.lora import Adapter
from asyncgrpo.server.routes.common import RouteTable, ServerInfo, SseStream, accepting, random_id, read_body
from asyncgrpo.server.routes.engine_requests import EngineRequests
from asyncgrpo.server.routes.models import ModelNames
from asyncgrpo.server.sequence import Sequence


class GenerateRoutes(RouteTable):
    """The token-in/token-out route over the engine."""

    ROUTES = (("POST", "/inference/v1/generate", "generate"),)

    def __init__(self, requests: EngineRequests, info: ServerInfo, names: ModelNames) -> None:
        self.requests = requests
        self.info = info
        self.spec = info.spec
        self.names = names

    async def generate(self, request: web.Request) -> web.StreamResponse:
        accepting(self.requests.engine)
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
                                  draw_seed=self.requests.draw_seed)
        rid = request.headers.get("X-Request-Id") or body.get("request_id") or random_id()
        key = f"generate-tokens-{rid}"
        seqs = self.requests.sequences(key, prompt, params, adapter)
        return_ids = bool(body.get("return_token_ids", False))
        include_usage = P.stream_include_usage(body)
        if body.get("stream"):
            return await self._stream(request, key, prompt, seqs, return_ids, include_usage)
        await self.requests.run([key], seqs)
        model = self.info.name if adapter is None else adapter.name
        text = R.generate_response(key, model, int(time.time()), prompt, seqs, return_ids)
        return web.Response(text=text, content_type="application/json")

    async def _stream(
        self, request: web.Request, key: str, prompt: list[int], seqs: list[Sequence], return_ids: bool,
        usage: bool,
    ) -> web.StreamResponse:
        async with self.requests.submitted([key], seqs, stream=True) as sink:
            stream = await SseStream.open(request)
            finished = 0
            first = True
            while finished < len(seqs):
                seq, start, end, final = await sink.queue.get()
                finished += int(final)
                if seq.error:
                    return await stream.fail(P.ApiError(500, seq.error))
                chunk: dict[str, Any] = {"request_id": key, "usage": None, "output_mode": "tokens"}
                if first and return_ids:
                    chunk["prompt_token_ids"] = prompt
                rendered = R.Rendered()
                chunk["choices"] = [R.generate_choice(seq, start, end, final, rendered)]
                first = False
                await stream.send(rendered.dumps(chunk))
            if usage:
                completion = sum(len(s.output) for s in seqs)
                tail = {"request_id": key, "usage": R.usage(len(prompt), completion, details=False),
                        "output_mode": "tokens", "choices": []}
                await stream.send(tail)
            return await stream.close()
