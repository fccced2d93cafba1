"""LoRA routes of the embedded server (`--enable-lora`), with vLLM 0.33's requests, answers and errors
(`entrypoints/serve/lora`, `entrypoints/openai/models/serving.py`):

    POST /v1/load_lora_adapter    {"lora_name", "lora_path", "load_inplace": false}
                                  200 text "Success: LoRA adapter '<name>' added successfully."
                                  400 InvalidUserInput: a name or path missing, the base model's name,
                                      a name already loaded (without load_inplace)
                                  404 NotFoundError: no adapter at the path
                                  500 InternalServerError: rank above --max-lora-rank, modules the
                                      server cannot adapt, no free slot, unreadable files
    POST /v1/unload_lora_adapter  {"lora_name"}: 200 text "...removed successfully.", 404 unknown name
    GET /v1/models                the base model's card, then one per adapter (`models.ModelNames`)

A request picks an adapter with `"model": "<lora_name>"` (/v1/completions, /inference/v1/generate,
/tokenize, /detokenize); an unknown name is vLLM's 404. Differences from vLLM: the routes need only
--enable-lora (vLLM also wants VLLM_ALLOW_RUNTIME_LORA_UPDATING=1, the embedded server having no other
way to get adapters); every loaded adapter keeps its slot, so loading one more than --max-loras is
refused (vLLM would evict one to its CPU cache and reload it from its path when used); a reload under
the same name never reuses the old weights' prefix-cache blocks. A failed load changes nothing: the
adapters loaded before keep serving.
"""

from __future__ import annotations

import asyncio
import logging

from aiohttp import web

from asyncgrpo.server import protocol as P
from asyncgrpo.server.engine import Engine
from asyncgrpo.server.lora import AdapterRegistry, ServedLora
from asyncgrpo.server.lora_files import AdapterLoadError, AdapterNotFound, read_adapter
from asyncgrpo.server.routes.common import RouteTable, engine_running, read_body

logger = logging.getLogger(__name__)


def _invalid(message: str) -> P.ApiError:
    return P.ApiError(400, message, err_type="InvalidUserInput")


def _string(body: dict, key: str) -> str:
    value = body.get(key)
    if not isinstance(value, str):
        raise P.ApiError(400, f"{key} must be a string, got {value!r}", param=key)
    return value


def lora_config(lora: ServedLora | None) -> dict | None:
    """/server_info's lora_config (vLLM's LoRAConfig fields the trainer checks), None when off."""
    if lora is None:
        return None
    return {"max_lora_rank": lora.max_rank, "max_loras": lora.max_loras,
            "max_cpu_loras": lora.max_loras, "fully_sharded_loras": False, "lora_dtype": "auto"}


class LoraRoutes(RouteTable):
    """Loading adapters into the engine's LoRA slots and dropping them (`base_name`: the served model's
    name, which no adapter may take)."""

    ROUTES = (("POST", "/v1/load_lora_adapter", "load_lora_adapter"),
              ("POST", "/v1/unload_lora_adapter", "unload_lora_adapter"))

    def __init__(self, engine: Engine, lora: ServedLora, adapters: AdapterRegistry, base_name: str) -> None:
        self.engine = engine
        self.lora = lora
        self.adapters = adapters
        self.base_name = base_name
        self.lock = asyncio.Lock()  # one adapter load or unload at a time

    async def load_lora_adapter(self, request: web.Request) -> web.Response:
        body = await read_body(request)
        name, path = _string(body, "lora_name"), _string(body, "lora_path")
        in_place = body.get("load_inplace", False)
        if not isinstance(in_place, bool):
            raise P.ApiError(400, f"load_inplace must be true or false, got {in_place!r}",
                             param="load_inplace")
        if not name or not path:
            raise _invalid("Both 'lora_name' and 'lora_path' must be provided.")
        if name == self.base_name:
            raise _invalid(f"The lora adapter '{name}' conflicts with a served base model.")
        engine_running(self.engine)
        async with self.lock:
            if not in_place and name in self.adapters.by_name:
                raise _invalid(
                    f"The lora adapter '{name}' has already been loaded. If you want to load the adapter in "
                    "place, set 'load_inplace' to True."
                )
            slot = self.adapters.reserve(name)
            if slot is None:
                raise P.ApiError(500, (
                    f"No free lora slots: all {len(self.adapters.slots)} (--max-loras) hold adapters "
                    f"({', '.join(self.adapters.holders())}); unload one with /v1/unload_lora_adapter, or "
                    f"restart the server with a larger --max-loras"
                ))
            try:
                weights = await asyncio.to_thread(read_adapter, name, path, self.lora.targets(),
                                                  self.lora.max_rank)
                await self.engine.call(lambda: self.lora.write(slot, weights))
            except AdapterNotFound as exc:
                self.adapters.release(slot)
                raise P.ApiError(404, str(exc)) from None
            except AdapterLoadError as exc:
                self.adapters.release(slot)
                raise P.ApiError(500, str(exc)) from None
            except BaseException:
                self.adapters.release(slot)
                raise
            self.adapters.add(name, path, slot, weights.rank)
        logger.info("Loaded new LoRA adapter: name '%s', path '%s' (rank %d, slot %d, %d modules)",
                    name, path, weights.rank, slot, len(weights.modules))
        return web.Response(text=f"Success: LoRA adapter '{name}' added successfully.")

    async def unload_lora_adapter(self, request: web.Request) -> web.Response:
        body = await read_body(request)
        name = _string(body, "lora_name")
        if not name:
            raise _invalid("'lora_name' needs to be provided to unload a LoRA adapter.")
        async with self.lock:
            if name not in self.adapters.by_name:
                raise P.ApiError(404, f"The lora adapter '{name}' cannot be found.")
            self.adapters.remove(name)
        logger.info("Removed LoRA adapter: name '%s'", name)
        return web.Response(text=f"Success: LoRA adapter '{name}' removed successfully.")
