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
    GET /v1/models                the base model's card, then one per adapter (root = its path,
                                  parent = the base model, max_model_len null)

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
import contextlib
import logging
import uuid
from typing import Any

from aiohttp import web

from asyncgrpo.server import protocol as P
from asyncgrpo.server.lora import Adapter
from asyncgrpo.server.lora_files import AdapterLoadError, AdapterNotFound, read_adapter

logger = logging.getLogger(__name__)

LORA_ROUTES = (("POST", "/v1/load_lora_adapter", "load_lora_adapter"),
               ("POST", "/v1/unload_lora_adapter", "unload_lora_adapter"))


def model_card(model_id: str, root: str, parent: str | None, max_model_len: int | None, created: int) -> dict:
    """One entry of /v1/models (vLLM's ModelCard)."""
    return {
        "id": model_id, "object": "model", "created": created, "owned_by": "vllm", "root": root, "parent": parent,
        "max_model_len": max_model_len,
        "permission": [{
            "id": f"modelperm-{uuid.uuid4().hex[:16]}", "object": "model_permission", "created": created,
            "allow_create_engine": False, "allow_sampling": True, "allow_logprobs": True,
            "allow_search_indices": False, "allow_view": True, "allow_fine_tuning": False,
            "organization": "*", "group": None, "is_blocking": False,
        }],
    }


def _invalid(message: str) -> P.ApiError:
    return P.ApiError(400, message, err_type="InvalidUserInput")


def _string(body: dict, key: str) -> str:
    value = body.get(key)
    if not isinstance(value, str):
        raise P.ApiError(400, f"{key} must be a string, got {value!r}", param=key)
    return value


class LoraRoutes:
    """Handlers of the LoRA routes and the model-name lookup (mixed into app.Server; `self.lora` and
    `self.adapters` are None without --enable-lora)."""

    def resolve_model(self, model: Any) -> Adapter | None:
        """The adapter a request's `model` names; None for the base model (or no name); 404 otherwise."""
        if self.adapters is not None and isinstance(model, str) and model in self.adapters.by_name:
            return self.adapters.by_name[model]
        P.check_model(model, self.spec)
        return None

    def adapter_in_use(self, adapter: Adapter | None) -> contextlib.AbstractContextManager:
        """Around a request's whole life: its adapter's slot stays its until it ends."""
        return contextlib.nullcontext() if adapter is None else self.adapters.using(adapter)

    def adapter_cards(self) -> list[dict]:
        if self.adapters is None:
            return []
        return [model_card(a.name, a.path, self.name, None, self.created) for a in self.adapters.by_name.values()]

    def lora_config(self) -> dict | None:
        """/server_info's lora_config (vLLM's LoRAConfig fields the trainer checks), None when off."""
        if self.lora is None:
            return None
        return {"max_lora_rank": self.lora.max_rank, "max_loras": self.lora.max_loras,
                "max_cpu_loras": self.lora.max_loras, "fully_sharded_loras": False, "lora_dtype": "auto"}

    async def load_lora_adapter(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        name, path = _string(body, "lora_name"), _string(body, "lora_path")
        in_place = body.get("load_inplace", False)
        if not isinstance(in_place, bool):
            raise P.ApiError(400, f"load_inplace must be true or false, got {in_place!r}", param="load_inplace")
        if not name or not path:
            raise _invalid("Both 'lora_name' and 'lora_path' must be provided.")
        if name == self.name:
            raise _invalid(f"The lora adapter '{name}' conflicts with a served base model.")
        if self.engine is None or not self.engine.alive:
            raise P.ApiError(500, "the generation engine is not running; see the server log")
        async with self.lora_lock:
            if not in_place and name in self.adapters.by_name:
                raise _invalid(
                    f"The lora adapter '{name}' has already been loaded. If you want to load the adapter in "
                    "place, set 'load_inplace' to True."
                )
            slot = self.adapters.reserve(name)
            if slot is None:
                raise P.ApiError(500, (
                    f"No free lora slots: all {len(self.adapters.slots)} (--max-loras) hold adapters "
                    f"({', '.join(self.adapters.holders())}); unload one with /v1/unload_lora_adapter, or restart "
                    f"the server with a larger --max-loras"
                ))
            try:
                weights = await asyncio.to_thread(read_adapter, name, path, self.lora.targets(), self.lora.max_rank)
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
        body = await self._body(request)
        name = _string(body, "lora_name")
        if not name:
            raise _invalid("'lora_name' needs to be provided to unload a LoRA adapter.")
        async with self.lora_lock:
            if name not in self.adapters.by_name:
                raise P.ApiError(404, f"The lora adapter '{name}' cannot be found.")
            self.adapters.remove(name)
        logger.info("Removed LoRA adapter: name '%s'", name)
        return web.Response(text=f"Success: LoRA adapter '{name}' removed successfully.")
