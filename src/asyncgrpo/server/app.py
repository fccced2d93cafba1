"""HTTP app of the embedded server (aiohttp): the subset of vLLM 0.33's protocol asyncgrpo uses.

Thin shell: it composes the route classes of `routes/`, each given the collaborators it names (the
engine, the weight transfer, the trainer hold, the server's description), with the error and auth
middlewares. Request parsing and response shapes live in `protocol.py` / `responses.py`, generation
in the engine thread (`engine.py`), which the generation routes share one `EngineRequests` of (sequence ids,
seeds, aborts), weight transfer in `weights.py`.

    routes/models.py    always        GET /health /version /v1/models /metrics
    routes/generate.py  always        POST /inference/v1/generate (stream or not)
    routes/completions.py always      POST /v1/completions (stream or not)
    routes/chat.py      always        POST /v1/chat/completions (the chat template, tool calls; stream or not)
    routes/text.py      always        POST /tokenize /detokenize
    routes/control.py   RL / dev      GET /server_info /get_world_size /is_paused, POST /pause /resume
                                      /abort_requests /inference/v1/abort_requests /reset_prefix_cache
    routes/weights.py   RL / dev      GET /weight_info /weight_checksum (not in vLLM), POST the
                                      weight-transfer routes
    routes/lease.py     extension     GET /lease, POST /renew_lease (the trainer lease; /pause takes lease_s)
    routes/lora.py      --enable-lora POST /v1/load_lora_adapter /v1/unload_lora_adapter (else 404, like
                                      vLLM without runtime LoRA); requests name an adapter in `model`
    routes/profile.py   --profiler-dir POST /start_profile /stop_profile (else 404, like vLLM without
                                      VLLM_TORCH_PROFILER_DIR)

With --api-key (or VLLM_API_KEY) every route but /health needs `Authorization: Bearer <key>`. Request
bodies are parsed as JSON only: nothing a client sends is ever unpickled.
"""

from __future__ import annotations

import asyncio
import hmac
import logging

from aiohttp import web

from asyncgrpo.server import protocol as P
from asyncgrpo.server.engine import Engine
from asyncgrpo.server.lease import Leases
from asyncgrpo.server.loading import ServedModel
from asyncgrpo.server.lora import AdapterRegistry
from asyncgrpo.server.metrics import ServerMetrics
from asyncgrpo.server.routes.chat import ChatRoutes
from asyncgrpo.server.routes.common import RouteTable, ServerInfo, json_response
from asyncgrpo.server.routes.completions import CompletionRoutes
from asyncgrpo.server.routes.control import ControlRoutes
from asyncgrpo.server.routes.engine_requests import EngineRequests
from asyncgrpo.server.routes.generate import GenerateRoutes
from asyncgrpo.server.routes.lease import LeaseRoutes, TrainerHold
from asyncgrpo.server.routes.lora import LoraRoutes
from asyncgrpo.server.routes.models import ModelNames, ServiceRoutes
from asyncgrpo.server.routes.profile import EngineProfiler, ProfileRoutes
from asyncgrpo.server.routes.text import TextCodec, TextRoutes
from asyncgrpo.server.routes.weights import WeightRoutes
from asyncgrpo.server.weights import WeightDeltaRejected, WeightTransfer, WeightTransferError

logger = logging.getLogger(__name__)

UNGUARDED_PATHS = frozenset({"/health"})  # what a load balancer or a launcher polls without the key
ALWAYS = (ServiceRoutes, GenerateRoutes, CompletionRoutes, ChatRoutes, TextRoutes, ControlRoutes,
          WeightRoutes, LeaseRoutes)
# (method, path, handler name) of the routes every embedded server has
ROUTES = tuple(route for routes in ALWAYS for route in routes.ROUTES)
MAX_BODY_BYTES = 256 * 2**20


class Server:
    """The embedded server around a built engine (`serve.build_server` assembles it): the collaborators
    the routes are given, the route classes, and the app that composes them."""

    def __init__(
        self,
        engine: Engine,
        served: ServedModel,
        info: ServerInfo,
        transfer: WeightTransfer,
        leases: Leases,
        metrics: ServerMetrics,
        adapters: AdapterRegistry | None = None,
        profiler: EngineProfiler | None = None,
        api_key: str | None = None,
    ) -> None:
        """adapters: the LoRA adapters' names and slots (--enable-lora), profiler: --profiler-dir's."""
        self.engine = engine
        self.served = served
        self.info = info
        self.transfer = transfer
        self.metrics = metrics
        self.hold = TrainerHold(leases, transfer, engine)
        self.stopping = asyncio.Event()  # set at shutdown: handlers stop waiting on blocked threads
        names = ModelNames(info, adapters)
        text = TextCodec(served.tokenizer, info.spec)
        requests = EngineRequests(engine, info.spec, info.seed)
        self.routes: list[RouteTable] = [
            ServiceRoutes(engine, names, metrics),
            GenerateRoutes(requests, info, names),
            CompletionRoutes(requests, info, names, text),
            ChatRoutes(requests, info, names, text),
            TextRoutes(text, names),
            ControlRoutes(engine, info, served, self.hold),
            WeightRoutes(engine, served.model, transfer, self.hold, metrics, self.stopping),
            LeaseRoutes(self.hold),
        ]
        if adapters is not None:
            self.routes.append(LoraRoutes(engine, engine.runner.lora, adapters, info.name))
        if profiler is not None:
            self.routes.append(ProfileRoutes(engine, profiler))
        self._auth_header = f"Bearer {api_key}".encode() if api_key else None

    @property
    def name(self) -> str:
        return self.info.name

    def app(self) -> web.Application:
        app = web.Application(middlewares=[_errors, self._auth], client_max_size=MAX_BODY_BYTES)
        add = {"GET": web.get, "POST": web.post}
        app.add_routes([add[method](path, handler) for routes in self.routes
                        for method, path, handler in routes.routes()])
        return app

    @web.middleware
    async def _auth(self, request: web.Request, handler):
        """With --api-key, every route but /health needs `Authorization: Bearer <key>` (vLLM guards only
        /v1: here pausing, weight pushes and metrics are as sensitive as generation)."""
        if self._auth_header is not None and request.path not in UNGUARDED_PATHS:
            given = request.headers.get("Authorization", "").encode()
            if not hmac.compare_digest(given, self._auth_header):
                return json_response({"error": "Unauthorized"}, 401)
        return await handler(request)


@web.middleware
async def _errors(request: web.Request, handler):
    """Errors as vLLM answers them: an `ApiError`'s body and status, a weight-transfer failure or any other
    exception a 500 ErrorResponse (logged with its traceback), unknown routes and methods as JSON; a
    rejected weight delta (an extension) 412."""
    try:
        return await handler(request)
    except P.ApiError as exc:
        return json_response(exc.body(), exc.status)
    except WeightDeltaRejected as exc:  # the trainer pushes the full weights next
        return json_response(P.error_body(str(exc), "PreconditionFailedError", 412), 412)
    except WeightTransferError as exc:
        return json_response(P.error_body(str(exc), "InternalServerError", 500), 500)
    except web.HTTPNotFound:
        return json_response({"detail": "Not Found"}, 404)
    except web.HTTPMethodNotAllowed:
        return json_response({"detail": "Method Not Allowed"}, 405)
    except (web.HTTPException, asyncio.CancelledError, ConnectionResetError):
        raise
    except Exception as exc:
        logger.exception("%s %s failed", request.method, request.path)
        return json_response(P.error_body(f"{type(exc).__name__}: {exc}", "InternalServerError", 500), 500)
