"""RL / dev routes of the embedded server (vLLM's `VLLM_SERVER_DEV_MODE` set): pause, resume, abort,
cache reset and the server's description (protocol sections 2.3, 5).

    GET  /server_info (?config_format=json, ?steps=N)  /get_world_size  /is_paused
    POST /pause (?mode=abort|wait|keep, ?clear_cache, ?lease_s)  /resume  /abort_requests
         /inference/v1/abort_requests  /reset_prefix_cache (?reset_running_requests)

Pause-route errors are `{"error": "<text>"}` (400). /pause takes the trainer lease's `lease_s` (an
embedded-server extension); /resume first abandons a weight transfer whose holder is gone.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import uuid
from typing import Any

from aiohttp import web

from asyncgrpo.server import protocol as P
from asyncgrpo.server.engine import Engine
from asyncgrpo.server.loading import ServedModel
from asyncgrpo.server.routes.common import (
    RouteTable,
    ServerInfo,
    json_response,
    query_bool,
    query_seconds,
    read_body,
)
from asyncgrpo.server.routes.lease import TrainerHold
from asyncgrpo.server.routes.lora import lora_config


def device_config(device) -> dict[str, Any]:
    """vLLM's `device_config` keys, plus the GPU's UUID on CUDA: a trainer on the same GPU (equal
    UUIDs) sends weights by CUDA IPC, since NCCL refuses two ranks on one GPU."""
    config: dict[str, Any] = {"device": device.type, "device_type": device.type}
    if device.type == "cuda":
        from asyncgrpo.sync.ipc import gpu_uuid

        config["device_uuid"] = gpu_uuid(device)
    return config


class ControlRoutes(RouteTable):
    """The engine's state and commands, and what the server says about itself."""

    ROUTES = (
        ("GET", "/server_info", "server_info"), ("GET", "/get_world_size", "world_size"),
        ("GET", "/is_paused", "is_paused"), ("POST", "/pause", "pause"), ("POST", "/resume", "resume"),
        ("POST", "/abort_requests", "abort_requests"),
        ("POST", "/inference/v1/abort_requests", "abort_requests"),
        ("POST", "/reset_prefix_cache", "reset_prefix_cache"),
    )

    def __init__(self, engine: Engine, info: ServerInfo, served: ServedModel, hold: TrainerHold) -> None:
        self.engine = engine
        self.info = info
        self.served = served
        self.hold = hold
        # names this server whatever address reaches it: a trainer listing it twice finds out at start
        self.instance_id = uuid.uuid4().hex

    async def server_info(self, request: web.Request) -> web.Response:
        info, e, s = self.info, self.info.engine, self.served
        runner, scheduler = self.engine.runner, self.engine.scheduler
        config = {
            "model_config": {
                "model": info.model, "tokenizer": info.model, "served_model_name": info.name,
                "dtype": str(s.dtype), "seed": info.seed, "max_model_len": info.spec.max_model_len,
                "max_logprobs": info.spec.max_logprobs, "logprobs_mode": "processed_logprobs",
                "return_sampling_mask": info.spec.return_sampling_mask,
                "skip_tokenizer_init": s.tokenizer is None,
            },
            "cache_config": {
                "block_size": runner.cache.block_size, "num_gpu_blocks": runner.cache.num_blocks,
                "cache_dtype": "auto", "kv_cache_size_tokens": e.kv_cache_tokens,
                "enable_prefix_caching": scheduler.pool.enable_caching,
            },
            "parallel_config": {
                "pipeline_parallel_size": 1, "tensor_parallel_size": 1, "data_parallel_size": 1,
                "data_parallel_size_local": 1, "world_size": 1, "rank": 0,
            },
            "scheduler_config": {
                "max_num_seqs": e.max_num_seqs, "max_num_batched_tokens": e.max_num_batched_tokens,
                "admission_interval": e.admission_interval, "async_scheduling": self.engine.async_scheduling,
                "policy": "fcfs",
            },
            "device_config": device_config(s.device),
            "lora_config": lora_config(runner.lora),
            "weight_transfer_config": {"backend": "nccl" if s.device.type == "cuda" else "gloo"},
        }
        st, graphs = self.engine.stats, runner.graphs
        embedded = {
            "device": str(s.device), "num_steps": st.num_steps, "max_num_seqs_per_step": st.max_batch_seqs,
            "num_prefill_steps": st.num_prefill_steps, "step_seconds": st.step_s,
            # device_wait: inside forward with synchronous steps, inside record with asynchronous ones
            "step_phase_seconds": {"schedule": st.schedule_s, "forward": st.forward_s, "record": st.record_s,
                                   "device_wait": runner.wait_s},
            "num_preemptions": st.num_preemptions,
            "graph_captures": 0 if graphs is None else graphs.num_captures,  # each one stalled a step
            "graph_capture_seconds": 0.0 if graphs is None else graphs.capture_s,
            # steps of a new shape run eagerly while a trainer in this process computed (capture_gate.py)
            "graph_captures_deferred": 0 if graphs is None else graphs.captures_deferred,
            "prefix_cache": {"queries": scheduler.pool.stats.queries, "hits": scheduler.pool.stats.hits},
            # how prompt chunks attend: packed for FlashAttention's variable-length kernel, or padded
            "prompt_attention": runner.plan.prompt_attention,
            # what /init_weight_transfer_engine accepts here ("ipc": JSON handles, same GPU only)
            "weight_transfer_backends": ["nccl", "gloo", "ipc"] if s.device.type == "cuda" else ["gloo"],
            # /update_weights takes a delta of the changed words over nccl and gloo (asyncgrpo.sync.delta)
            "weight_deltas": True,
            "pid": os.getpid(),  # a trainer sees whether the server runs in its own process (ServerThread)
            "instance_id": self.instance_id,
        }
        steps = request.query.get("steps")
        if steps is not None:  # the last N steps, oldest first (EngineStats.recent)
            if not steps.isdigit():
                raise P.ApiError(400, f"steps must be a whole number of recent steps to list, got {steps!r}")
            recent = list(st.recent)[-int(steps):] if int(steps) else []
            embedded["recent_steps"] = [dataclasses.asdict(r) for r in recent]
        fmt = request.query.get("config_format", "text")
        return json_response({
            "vllm_config": config if fmt == "json" else json.dumps(config),
            "vllm_env": {}, "system_env": {}, "embedded": embedded,
        })

    async def world_size(self, request: web.Request) -> web.Response:
        return json_response({"world_size": 1})

    async def is_paused(self, request: web.Request) -> web.Response:
        return json_response({"is_paused": self.engine.pause_mode is not None})

    async def pause(self, request: web.Request) -> web.Response:
        mode = request.query.get("mode", "abort")
        try:
            if mode not in ("abort", "wait", "keep"):
                raise ValueError(f"mode must be one of abort, wait, keep; got {mode!r}")
            clear_cache = query_bool(request, "clear_cache", True)
            lease_s = query_seconds(request, "lease_s")
        except ValueError as exc:
            return json_response({"error": str(exc)}, 400)
        # shielded: a client gone mid-call (its handler is cancelled) must not leave the engine paused
        # without the lease booked
        await asyncio.shield(self._pause(mode, clear_cache, lease_s))
        return json_response({"status": "paused"})

    async def _pause(self, mode: str, clear_cache: bool, lease_s: float | None) -> None:
        await self.engine.pause(mode, clear_cache)
        self.hold.leases.paused(lease_s)  # an embedded-server extension; vLLM's clients get --trainer-lease

    async def resume(self, request: web.Request) -> web.Response:
        await asyncio.shield(self._resume())  # as pause: the engine and the books change together
        return json_response({"status": "resumed"})

    async def _resume(self) -> None:
        if self.hold.transfer.active and not await self.hold.holder_alive():
            await self.hold.abandon_transfer()  # its sender is gone: it would never finish
        await self.engine.resume()
        self.hold.leases.resumed()

    async def abort_requests(self, request: web.Request) -> web.Response:
        try:
            body = await read_body(request, required=False)
        except P.ApiError as exc:
            return json_response({"error": exc.message}, 400)
        ids = body.get("request_ids") or None
        if ids is not None and not (isinstance(ids, list) and all(isinstance(i, str) for i in ids)):
            return json_response({"error": "request_ids must be a list of strings"}, 400)
        return json_response({"status": "aborted", "aborted": await self.engine.abort(ids)})

    async def reset_prefix_cache(self, request: web.Request) -> web.Response:
        """As vLLM: forget every cached prefix; fails while requests hold KV blocks unless
        reset_running_requests=true, which preempts them (they re-prefill later)."""
        try:
            reset_running = query_bool(request, "reset_running_requests", False)
        except ValueError as exc:
            return json_response({"error": str(exc)}, 400)

        def reset() -> bool:
            success, num_preempted = self.engine.scheduler.reset_prefix_cache(reset_running)
            self.engine.stats.num_preemptions += num_preempted
            return success

        return json_response({"success": await self.engine.call(reset)})
