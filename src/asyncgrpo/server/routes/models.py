"""The always-on service routes (GET /health /version /v1/models /metrics) and the names requests give
in `model`: the served model (or none) or a loaded LoRA adapter (`--enable-lora`), with vLLM's cards.
"""

from __future__ import annotations

import contextlib
import uuid
from typing import Any

from aiohttp import web

from asyncgrpo.server import protocol as P
from asyncgrpo.server.engine import Engine
from asyncgrpo.server.lora import Adapter, AdapterRegistry
from asyncgrpo.server.metrics import CONTENT_TYPE_LATEST, ServerMetrics
from asyncgrpo.server.routes.common import RouteTable, ServerInfo, json_response


def model_card(model_id: str, root: str, parent: str | None, max_model_len: int | None, created: int) -> dict:
    """One entry of /v1/models (vLLM's ModelCard)."""
    return {
        "id": model_id, "object": "model", "created": created, "owned_by": "vllm", "root": root,
        "parent": parent, "max_model_len": max_model_len,
        "permission": [{
            "id": f"modelperm-{uuid.uuid4().hex[:16]}", "object": "model_permission", "created": created,
            "allow_create_engine": False, "allow_sampling": True, "allow_logprobs": True,
            "allow_search_indices": False, "allow_view": True, "allow_fine_tuning": False,
            "organization": "*", "group": None, "is_blocking": False,
        }],
    }


class ModelNames:
    """Which model a request names (/v1/completions, /inference/v1/generate, /tokenize, /detokenize):
    `adapters` is None without --enable-lora."""

    def __init__(self, info: ServerInfo, adapters: AdapterRegistry | None) -> None:
        self.info = info
        self.adapters = adapters

    def resolve(self, model: Any) -> Adapter | None:
        """The adapter a request's `model` names; None for the base model (or no name); 404 otherwise."""
        if self.adapters is not None and isinstance(model, str) and model in self.adapters.by_name:
            return self.adapters.by_name[model]
        P.check_model(model, self.info.spec)
        return None

    def in_use(self, adapter: Adapter | None) -> contextlib.AbstractContextManager:
        """Around a request's whole life: its adapter's slot stays its until it ends."""
        return contextlib.nullcontext() if adapter is None else self.adapters.using(adapter)

    def cards(self) -> list[dict]:
        """The base model's card, then one per loaded adapter (root: its path, parent: the base model)."""
        info = self.info
        cards = [model_card(info.name, info.model, None, info.spec.max_model_len, info.created)]
        if self.adapters is not None:
            cards += [model_card(a.name, a.path, info.name, None, info.created)
                      for a in self.adapters.by_name.values()]
        return cards


class ServiceRoutes(RouteTable):
    """GET /health (200 while the engine runs, else 503), /version, /v1/models, /metrics (Prometheus)."""

    ROUTES = (("GET", "/health", "health"), ("GET", "/version", "version"), ("GET", "/v1/models", "models"),
              ("GET", "/metrics", "metrics"))

    def __init__(self, engine: Engine, names: ModelNames, metrics: ServerMetrics) -> None:
        self.engine = engine
        self.names = names
        self.server_metrics = metrics

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=200 if self.engine.alive else 503)

    async def version(self, request: web.Request) -> web.Response:
        return json_response({"version": P.VERSION})

    async def models(self, request: web.Request) -> web.Response:
        return json_response({"object": "list", "data": self.names.cards()})

    async def metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=self.server_metrics.render(), headers={"Content-Type": CONTENT_TYPE_LATEST})
