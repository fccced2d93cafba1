"""HTTP routes of the embedded server (aiohttp): the subset of vLLM 0.33's protocol asyncgrpo uses.

Thin shell: request parsing and response shapes live in `protocol.py`, generation in the engine
thread (`engine.py`), weight transfer in `weights.py`. Every handler only validates, hands work
to the engine, awaits it and serialises the answer.

    always        GET /health /version /v1/models /metrics, POST /v1/completions /tokenize /detokenize
    scale-out     POST /inference/v1/generate (stream or not), /inference/v1/abort_requests
    RL / dev      /pause /resume /is_paused /abort_requests /reset_prefix_cache /server_info
                  /get_world_size /weight_info and the weight-transfer routes
    extension     GET /weight_checksum (digests of the served weights; not in vLLM),
                  GET /lease, POST /renew_lease (the trainer lease, `holding.py`; /pause takes lease_s)
    --enable-lora POST /v1/load_lora_adapter /v1/unload_lora_adapter (`lora_routes.py`; else 404, like
                  vLLM without runtime LoRA); requests name an adapter in `model`
    --profiler-dir POST /start_profile /stop_profile (`profiling.py`; else 404, like vLLM without
                  VLLM_TORCH_PROFILER_DIR)

With --api-key (or VLLM_API_KEY) every route but /health needs `Authorization: Bearer <key>`. Request
bodies are parsed as JSON only: nothing a client sends is ever unpickled.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import hmac
import itertools
import json
import logging
import os
import random
import time
from typing import Any

from aiohttp import web

from asyncgrpo.server import protocol as P
from asyncgrpo.server import responses as R
from asyncgrpo.server.attention_math import kv_window
from asyncgrpo.server.control import ControlRoutes
from asyncgrpo.server.engine import Engine, warm_up
from asyncgrpo.server.holding import HoldingRoutes
from asyncgrpo.server.kv_cache import PagedKVCache
from asyncgrpo.server.lease import Leases
from asyncgrpo.server.loading import ServedModel
from asyncgrpo.server.lora import Adapter, AdapterRegistry, ServedLora
from asyncgrpo.server.lora_routes import LORA_ROUTES, LoraRoutes, model_card
from asyncgrpo.server.metrics import CONTENT_TYPE_LATEST, ServerMetrics
from asyncgrpo.server.prefix_cache import BlockPool, prefix_caching_enabled
from asyncgrpo.server.profiling import PROFILE_ROUTES, EngineProfiler, ProfileRoutes
from asyncgrpo.server.recurrent_state import RecurrentState
from asyncgrpo.server.runner import ModelRunner
from asyncgrpo.server.scheduler import Scheduler
from asyncgrpo.server.sequence import Sequence
from asyncgrpo.server.step_graphs import StepGraphs
from asyncgrpo.server.text_routes import TextRoutes
from asyncgrpo.server.weights import WeightLoader, WeightTransfer, WeightTransferError

logger = logging.getLogger(__name__)

BLOCK_SIZE = 16
UNGUARDED_PATHS = frozenset({"/health"})  # what a load balancer or a launcher polls without the key
ROUTES = (  # (method, path, handler name)
    ("GET", "/health", "health"), ("GET", "/version", "version"), ("GET", "/v1/models", "models"),
    ("GET", "/metrics", "metrics_route"), ("GET", "/server_info", "server_info"),
    ("GET", "/get_world_size", "world_size"), ("GET", "/is_paused", "is_paused"),
    ("GET", "/weight_info", "weight_info"), ("GET", "/weight_checksum", "weight_checksum"),
    ("POST", "/v1/completions", "completions"), ("POST", "/inference/v1/generate", "generate"),
    ("POST", "/tokenize", "tokenize"), ("POST", "/detokenize", "detokenize"),
    ("POST", "/pause", "pause"), ("POST", "/resume", "resume"), ("POST", "/abort_requests", "abort_requests"),
    ("POST", "/inference/v1/abort_requests", "abort_requests"), ("POST", "/reset_prefix_cache", "reset_prefix_cache"),
    ("POST", "/init_weight_transfer_engine", "init_transfer"), ("POST", "/start_weight_update", "start_update"),
    ("POST", "/update_weights", "update_weights"), ("POST", "/finish_weight_update", "finish_update"),
    ("POST", "/shutdown_weight_transfer_engine", "shutdown_transfer"),
    ("POST", "/update_weight_version", "update_weight_version"),
    ("GET", "/lease", "lease"), ("POST", "/renew_lease", "renew_lease"),
)
_SSE = {"Content-Type": "text/event-stream; charset=utf-8", "Cache-Control": "no-cache"}


def _json(data: Any, status: int = 200) -> web.Response:
    return web.json_response(data, status=status)


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


class Server(ControlRoutes, HoldingRoutes, LoraRoutes, TextRoutes, ProfileRoutes):
    def __init__(self, args: argparse.Namespace, served: ServedModel, kv_tokens: int) -> None:
        self.args = args
        self.served = served
        self.name = args.served_model_name or args.model
        self.kv_tokens = kv_tokens
        self.spec = P.ServerSpec(
            served_name=self.name,
            max_model_len=served.max_model_len,
            max_num_seqs=args.max_num_seqs,
            max_logprobs=args.max_logprobs,
            vocab_size=served.vocab_size,
            return_sampling_mask=args.return_sampling_mask,
            eos_token_id=served.eos_token_id,
            extra_eos_ids=served.extra_eos_ids,
            media_token_ids=served.media_token_ids,
        )
        self.metrics = ServerMetrics(self.name)
        self.cache = PagedKVCache(
            served.num_layers, kv_tokens // BLOCK_SIZE, BLOCK_SIZE, served.num_kv_heads, served.head_dim,
            served.dtype, served.device, served.attention_layers,
        )
        caching = prefix_caching_enabled(args.enable_prefix_caching, served.model.config.get_text_config())
        self.recurrent = RecurrentState.for_model(served.model, args.max_num_seqs, served.device)
        self.scheduler = Scheduler(
            BlockPool(self.cache.num_blocks, caching), BLOCK_SIZE, args.max_num_seqs, args.max_num_batched_tokens,
            served.max_model_len, window=kv_window(served.model, served.attention_layers),
            admission_interval=args.admission_interval,
        )
        self.lora = ServedLora(served.model, args.max_loras, args.max_lora_rank) if args.enable_lora else None
        self.adapters = AdapterRegistry(args.max_loras) if args.enable_lora else None
        self.profiler = EngineProfiler(args.profiler_dir, served.device) if args.profiler_dir else None
        self.lora_lock = asyncio.Lock()  # one adapter load or unload at a time
        graphs = None
        if served.device.type == "cuda" and not args.enforce_eager:
            graphs = StepGraphs(
                served.model, self.cache, served.device, args.max_num_seqs, self.scheduler.max_blocks, True,
                served.vocab_size, lora=self.lora, recurrent=self.recurrent,
            )
        self.runner = ModelRunner(
            served.model, self.cache, served.device, served.vocab_size, self.scheduler.block_table, graphs,
            self.recurrent, self.lora, varlen_prompts=False if args.prompt_attention == "padded" else None,
        )
        self.async_scheduling = (served.device.type == "cuda" if args.async_scheduling is None
                                 else args.async_scheduling)
        self.transfer = WeightTransfer(served.device, WeightLoader(served.model), args.weight_transfer_timeout)
        self._init_started: float | None = None  # monotonic start of the weight-transfer init in progress
        self.leases = Leases(args.trainer_lease)
        self.engine: Engine | None = None
        self.created = int(time.time())
        self._rng = random.Random(args.seed)
        self._seq_ids = itertools.count()
        self._num_updates = 0
        self._auth_header = f"Bearer {args.api_key}".encode() if args.api_key else None

    # ---- plumbing ---------------------------------------------------------------------------------
    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._errors, self._auth], client_max_size=256 * 2**20)
        add = {"GET": web.get, "POST": web.post}
        routes = (ROUTES + (LORA_ROUTES if self.lora is not None else ())
                  + (PROFILE_ROUTES if self.profiler is not None else ()))
        app.add_routes([add[method](path, getattr(self, handler)) for method, path, handler in routes])
        return app

    def start_engine(self, loop: asyncio.AbstractEventLoop, stream=None) -> None:
        """Warm up and start the engine thread (`stream`: its CUDA stream; None: the default one)."""
        self.stopping = asyncio.Event()  # set on SIGTERM / SIGINT: handlers stop waiting on blocked threads
        warm_up(self.runner, self.scheduler)
        # what start-up built (modules, model, tokenizer) lives as long as the server: keep it out of
        # the collector's full passes, which otherwise stall both threads for ~0.1 s every few thousand
        # requests
        gc.collect()
        gc.freeze()
        self.engine = Engine(self.runner, self.scheduler, loop, on_update=self._on_engine_update,
                             async_scheduling=self.async_scheduling, stream=stream)
        self.engine.start()

    def _on_engine_update(self, engine: Engine) -> None:
        s = self.scheduler
        self.metrics.update(len(s.running), len(s.waiting), s.kv_usage(), engine.stats, s.pool.stats)

    @web.middleware
    async def _errors(self, request: web.Request, handler):
        try:
            return await handler(request)
        except P.ApiError as exc:
            return _json(exc.body(), exc.status)
        except WeightTransferError as exc:
            return _json(P.error_body(str(exc), "InternalServerError", 500), 500)
        except web.HTTPNotFound:
            return _json({"detail": "Not Found"}, 404)
        except web.HTTPMethodNotAllowed:
            return _json({"detail": "Method Not Allowed"}, 405)
        except (web.HTTPException, asyncio.CancelledError, ConnectionResetError):
            raise
        except Exception as exc:
            logger.exception("%s %s failed", request.method, request.path)
            return _json(P.error_body(f"{type(exc).__name__}: {exc}", "InternalServerError", 500), 500)

    @web.middleware
    async def _auth(self, request: web.Request, handler):
        """With --api-key, every route but /health needs `Authorization: Bearer <key>` (vLLM guards only
        /v1: here pausing, weight pushes and metrics are as sensitive as generation)."""
        if self._auth_header is not None and request.path not in UNGUARDED_PATHS:
            given = request.headers.get("Authorization", "").encode()
            if not hmac.compare_digest(given, self._auth_header):
                return _json({"error": "Unauthorized"}, 401)
        return await handler(request)

    async def _body(self, request: web.Request, required: bool = True) -> dict:
        text = await request.text()
        if not text.strip() and not required:
            return {}
        try:
            body = json.loads(text)
        except ValueError as exc:  # JSONDecodeError, or an integer of more than 4300 digits
            raise P.ApiError(400, f"the request body is not valid JSON: {exc}") from exc
        except RecursionError:
            raise P.ApiError(400, "the request body nests JSON arrays or objects too deeply") from None
        if not isinstance(body, dict):
            raise P.ApiError(400, "the request body must be a JSON object")
        return body

    def _accepting(self) -> None:
        if self.engine is None or not self.engine.alive:
            raise P.ApiError(500, "the generation engine is not running; see the server log")
        if self.engine.pause_mode in ("abort", "wait"):
            raise P.ApiError(503, P.PAUSED_MESSAGE)

    def _draw_seed(self) -> int:
        return self._rng.getrandbits(63)

    def _sequences(self, key: str, prompt: list[int], params, adapter: Adapter | None) -> list[Sequence]:
        seqs = [
            Sequence(next(self._seq_ids), key, i, prompt, p, self.spec.max_model_len) for i, p in enumerate(params)
        ]
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

    # ---- always-on routes -------------------------------------------------------------------------
    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=200 if self.engine is not None and self.engine.alive else 503)

    async def version(self, request: web.Request) -> web.Response:
        return _json({"version": P.VERSION})

    async def models(self, request: web.Request) -> web.Response:
        card = model_card(self.name, self.args.model, None, self.spec.max_model_len, self.created)
        return _json({"object": "list", "data": [card, *self.adapter_cards()]})

    async def metrics_route(self, request: web.Request) -> web.Response:
        return web.Response(body=self.metrics.render(), headers={"Content-Type": CONTENT_TYPE_LATEST})

    # ---- generation -------------------------------------------------------------------------------
    async def generate(self, request: web.Request) -> web.StreamResponse:
        self._accepting()
        body = await self._body(request)
        adapter = self.resolve_model(body.get("model"))
        with self.adapter_in_use(adapter):
            return await self._generate(request, body, adapter)

    async def _generate(self, request: web.Request, body: dict, adapter: Adapter | None) -> web.StreamResponse:
        if body.get("output_mode", "tokens") not in (None, "tokens"):
            raise P.ApiError(400, "output_mode must be 'tokens' on the embedded server", param="output_mode")
        prompt = P.token_id_list(body.get("token_ids"), self.spec, "token_ids")
        P.check_text_only(body, [prompt], self.spec, "token_ids")
        params = P.parse_sampling(
            body.get("sampling_params") or {}, self.spec, len(prompt), route="generate", draw_seed=self._draw_seed
        )
        rid = request.headers.get("X-Request-Id") or body.get("request_id") or _random_id()
        key = f"generate-tokens-{rid}"
        seqs = self._sequences(key, prompt, params, adapter)
        return_ids = bool(body.get("return_token_ids", False))
        include_usage = P.stream_include_usage(body)
        if body.get("stream"):
            return await self._stream(request, key, prompt, seqs, return_ids, include_usage)
        await self._run(key, seqs)
        model = self.name if adapter is None else adapter.name
        text = R.generate_response(key, model, int(time.time()), prompt, seqs, return_ids)
        return web.Response(text=text, content_type="application/json")

    async def _stream(
        self, request: web.Request, key: str, prompt: list[int], seqs: list[Sequence], return_ids: bool, usage: bool
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

    async def completions(self, request: web.Request) -> web.Response:
        self._accepting()
        body = await self._body(request)
        adapter = self.resolve_model(body.get("model"))
        with self.adapter_in_use(adapter):
            return await self._completions(request, body, adapter)

    async def _completions(self, request: web.Request, body: dict, adapter: Adapter | None) -> web.Response:
        for key, bad in (("stream", True), ("echo", True), ("suffix", None), ("prompt_logprobs", None)):
            if body.get(key) not in (None, False) and (bad is True or body.get(key) is not None):
                raise P.ApiError(400, f"{key} is not supported on /v1/completions by the embedded server", param=key)
        P.stream_include_usage(body)  # validated like vLLM even though streaming is not offered here
        prompts = self._prompts(body.get("prompt"))
        P.check_text_only(body, prompts, self.spec, "prompt")
        rid = body.get("request_id") or request.headers.get("X-Request-Id") or _random_id()
        all_seqs = []
        for i, prompt in enumerate(prompts):
            params = P.parse_sampling(body, self.spec, len(prompt), route="completions", draw_seed=self._draw_seed)
            all_seqs.append(self._sequences(f"cmpl-{rid}-{i}", prompt, params, adapter))
        await asyncio.gather(*(self._run(seqs[0].request_key, seqs) for seqs in all_seqs))
        tok = self.served.tokenizer
        texts = [[tok.decode(s.output, skip_special_tokens=True) if tok else "" for s in seqs] for seqs in all_seqs]
        as_ids = bool(body.get("return_tokens_as_token_ids", False)) or tok is None

        def decode(t: int) -> str:
            return tok.decode([t])

        lps = [
            [R.completion_logprobs(s, decode, as_ids) if s.params.logprobs is not None else None for s in seqs]
            for seqs in all_seqs
        ]
        out = R.completion_response(
            f"cmpl-{rid}", self.name if adapter is None else adapter.name, int(time.time()), prompts, all_seqs,
            texts, lps,
            bool(body.get("return_token_ids", False)), bool(body.get("return_weight_versions", False)),
        )
        return _json(out)
