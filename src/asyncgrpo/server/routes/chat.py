"""POST /v1/chat/completions: OpenAI chat completions in vLLM 0.33's shapes, answered whole or streamed.

    body --chat.parse_chat_request--> ChatRequest --chat.render_prompt (the model's chat template)--> prompt
         --protocol.parse_sampling (route "chat")--> n sequences, one engine request `chatcmpl-<id>`
         --EngineRequests.submitted--> events --choices.follow (text, stop strings)-->
         chat.assistant_message (tool calls parsed back) --> chat.completion body, or chunks

Streaming (`stream: true`): per choice a first chunk with `delta.role`, then per engine step its new text
(`delta.content`), log-probs and token ids; the finish reason on its last chunk; with tools, the content
and the `delta.tool_calls` come whole in that last chunk (the calls are parsed from the whole text). A usage
chunk with `stream_options.include_usage`, then `data: [DONE]`.
"""

from __future__ import annotations

import os
import time
from typing import Any

from aiohttp import web

from asyncgrpo.data.tool_calls import calls_to_wire
from asyncgrpo.server import protocol as P
from asyncgrpo.server import responses as R
from asyncgrpo.server.chat import ChatRequest, assistant_message, parse_chat_request, render_prompt
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


class ChatRoutes(RouteTable):
    """/v1/chat/completions over the engine, rendered with the served model's tokenizer and chat template."""

    ROUTES = (("POST", "/v1/chat/completions", "chat_completions"),)

    def __init__(self, requests: EngineRequests, info: ServerInfo, names: ModelNames,
                 text: TextCodec) -> None:
        self.requests = requests
        self.info = info
        self.spec = info.spec
        self.names = names
        self.text = text

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        accepting(self.requests.engine)
        body = await read_body(request)
        adapter = self.names.resolve(body.get("model"))
        with self.names.in_use(adapter):
            return await self._chat(request, body, adapter)

    async def _chat(self, request: web.Request, body: dict, adapter: Adapter | None) -> web.StreamResponse:
        chat = parse_chat_request(body)
        include_usage = P.stream_include_usage(body)
        tok = self.text.tokenizer
        prompt_text, prompt = render_prompt(tok, chat, self.info.name)
        P.check_text_only(body, [prompt], self.spec, "messages")
        params = P.parse_sampling(chat.sampling, self.spec, len(prompt), route="chat",
                                  draw_seed=self.requests.draw_seed)
        key = f"chatcmpl-{body.get('request_id') or request.headers.get('X-Request-Id') or random_id()}"
        seqs = self.requests.sequences(key, prompt, params, adapter)
        stream = bool(body.get("stream"))
        skip_special = chat.skip_special_tokens and not chat.parse_tools  # tool-call markers may be special

        def decode(ids: list[int]) -> str:
            return tok.decode(ids, skip_special_tokens=skip_special)

        incremental = stream or bool(chat.stop)
        choices = [Choice(s.index, s, decode, chat.stop, chat.include_stop_str, incremental) for s in seqs]
        model = self.info.name if adapter is None else adapter.name
        reply = _Reply(key, model, chat, tok, prompt_text, prompt)
        async with self.requests.submitted([key], seqs, stream=incremental) as sink:
            if stream:
                return await self._stream(request, reply, choices, sink, include_usage)
            async for _ in follow(sink, choices):
                pass
        out = R.chat_response(key, reply.model, reply.created, [reply.choice(c) for c in choices], prompt,
                              sum(c.num_tokens for c in choices), chat.return_token_ids)
        return json_response(out)

    async def _stream(self, request: web.Request, reply: _Reply, choices: list[Choice], sink: RequestSink,
                      include_usage: bool) -> web.StreamResponse:
        stream = await SseStream.open(request)
        extra = {"prompt_token_ids": reply.prompt} if reply.chat.return_token_ids else {}
        for c in choices:
            first = R.chat_delta(c.index, {"role": "assistant", "content": ""})
            await stream.send(R.chat_chunk(reply.id, reply.model, reply.created, [first], **extra))
        try:
            async for choice, start in follow(sink, choices):
                delta = reply.stream_delta(choice, start)
                if delta is not None:
                    await stream.send(R.chat_chunk(reply.id, reply.model, reply.created, [delta]))
        except P.ApiError as exc:
            return await stream.fail(exc)
        if include_usage:
            tail = R.usage(len(reply.prompt), sum(c.num_tokens for c in choices), details=False)
            await stream.send(R.chat_chunk(reply.id, reply.model, reply.created, [], usage=tail))
        return await stream.close()


class _Reply:
    """What the choices of one chat request share in the answer, and each choice's message."""

    def __init__(self, request_id: str, model: str, chat: ChatRequest, tokenizer: Any, prompt_text: str,
                 prompt: list[int]) -> None:
        self.id = request_id
        self.model = model
        self.created = int(time.time())
        self.chat = chat
        self.tokenizer = tokenizer
        self.prompt_text = prompt_text
        self.prompt = prompt

    def _token(self, t: int) -> str:
        return self.tokenizer.decode([t])

    def _logprobs(self, c: Choice, start: int) -> list[dict] | None:
        k = self.chat.top_logprobs
        return None if k is None else R.chat_logprobs(c.seq, start, c.num_tokens, self._token,
                                                      self.chat.tokens_as_ids, k)

    def _message(self, c: Choice) -> tuple[str | None, list[dict], str | None, tuple]:
        """(content, tool calls in the OpenAI form, reasoning, (finish_reason, stop_reason)) of an ended
        choice."""
        text = c.text.finish()
        content, calls, reasoning = assistant_message(self.tokenizer, text, self.prompt_text, self.chat)
        wire = calls_to_wire(calls, [f"chatcmpl-tool-{os.urandom(16).hex()}" for _ in calls])
        finish = ("tool_calls", c.finish[1]) if calls else c.finish  # as vLLM: whatever ended the text
        return content, wire, reasoning, finish

    def choice(self, c: Choice) -> dict[str, Any]:
        content, calls, reasoning, finish = self._message(c)
        versions = R.weight_versions(c.seq, c.num_tokens) if self.chat.return_weight_versions else None
        return R.chat_choice(c.index, R.chat_message(content, calls, reasoning), self._logprobs(c, 0), finish,
                             c.token_ids if self.chat.return_token_ids else None, versions)

    def stream_delta(self, c: Choice, start: int) -> dict[str, Any] | None:
        """The choice of the chunk for a choice's new tokens [start, num_tokens); None when it has nothing."""
        delta: dict[str, Any] = {}
        finish = None
        if not self.chat.parse_tools:
            text = c.text.delta(final=c.finished)
            if text:
                delta["content"] = text
            finish = c.finish if c.finished else None
        elif c.finished:
            content, calls, reasoning, finish = self._message(c)
            if content:
                delta["content"] = content
            if reasoning:
                delta["reasoning"] = reasoning
            if calls:
                delta["tool_calls"] = [{"index": i, **call} for i, call in enumerate(calls)]
        lps = self._logprobs(c, start) if c.num_tokens > start else None
        token_ids = c.seq.output[start:c.num_tokens] if self.chat.return_token_ids else None
        if not (delta or lps or token_ids or finish):
            return None
        return R.chat_delta(c.index, delta, lps, finish, token_ids)
