"""RL / dev routes of the embedded server (vLLM's `VLLM_SERVER_DEV_MODE` set): pause, resume,
abort, cache reset, server description and the weight-transfer routes (protocol sections 2.3, 5).

A mixin of `app.Server`: handlers use its engine, scheduler, weight transfer and metrics. Pause-route
errors are `{"error": "<text>"}` (400), weight-route errors vLLM's ErrorResponse with 500.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import time
from typing import Any

from aiohttp import web

from asyncgrpo.server import protocol as P
from asyncgrpo.server.holding import trainer_id
from asyncgrpo.sync import in_daemon_thread
from asyncgrpo.sync.checksum import weights_checksum


def _json(data, status: int = 200) -> web.Response:
    return web.json_response(data, status=status)


def _query_seconds(request: web.Request, key: str) -> float | None:
    value = request.query.get(key)
    if value is None:
        return None
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if not 0 <= seconds < float("inf"):
        raise ValueError(f"{key} must be a number of seconds >= 0 (0: no expiry), got {value!r}")
    return seconds


def _query_bool(request: web.Request, key: str, default: bool) -> bool:
    value = request.query.get(key)
    if value is None:
        return default
    if value.lower() in ("true", "1", "yes"):
        return True
    if value.lower() in ("false", "0", "no"):
        return False
    raise ValueError(f"{key} must be true or false, got {value!r}")


def device_config(device) -> dict[str, Any]:
    """vLLM's `device_config` keys, plus the GPU's UUID on CUDA: a trainer on the same GPU (equal
    UUIDs) sends weights by CUDA IPC, since NCCL refuses two ranks on one GPU."""
    config: dict[str, Any] = {"device": device.type, "device_type": device.type}
    if device.type == "cuda":
        from asyncgrpo.sync.ipc import gpu_uuid

        config["device_uuid"] = gpu_uuid(device)
    return config


class ControlRoutes:
    """Handlers of the RL / dev routes (mixed into app.Server)."""

    async def server_info(self, request: web.Request) -> web.Response:
        a, s = self.args, self.served
        config = {
            "model_config": {
                "model": a.model, "tokenizer": a.model, "served_model_name": self.name,
                "dtype": str(s.dtype), "seed": a.seed, "max_model_len": self.spec.max_model_len,
                "max_logprobs": a.max_logprobs, "logprobs_mode": "processed_logprobs",
                "return_sampling_mask": a.return_sampling_mask, "skip_tokenizer_init": s.tokenizer is None,
            },
            "cache_config": {
                "block_size": self.cache.block_size, "num_gpu_blocks": self.cache.num_blocks, "cache_dtype": "auto",
                "kv_cache_size_tokens": self.kv_tokens,
                "enable_prefix_caching": self.scheduler.pool.enable_caching,
            },
            "parallel_config": {
                "pipeline_parallel_size": 1, "tensor_parallel_size": 1, "data_parallel_size": 1,
                "data_parallel_size_local": 1, "world_size": 1, "rank": 0,
            },
            "scheduler_config": {
                "max_num_seqs": a.max_num_seqs, "max_num_batched_tokens": a.max_num_batched_tokens,
                "admission_interval": a.admission_interval, "async_scheduling": self.async_scheduling,
                "policy": "fcfs",
            },
            "device_config": device_config(s.device),
            "lora_config": self.lora_config(),
            "weight_transfer_config": {"backend": "nccl" if s.device.type == "cuda" else "gloo"},
        }
        st, graphs = self.engine.stats, self.runner.graphs
        embedded = {
            "device": str(s.device), "num_steps": st.num_steps, "max_num_seqs_per_step": st.max_batch_seqs,
            "num_prefill_steps": st.num_prefill_steps, "step_seconds": st.step_s,
            # device_wait: inside forward with synchronous steps, inside record with asynchronous ones
            "step_phase_seconds": {"schedule": st.schedule_s, "forward": st.forward_s, "record": st.record_s,
                                   "device_wait": self.runner.wait_s},
            "num_preemptions": st.num_preemptions,
            "graph_captures": 0 if graphs is None else graphs.num_captures,  # each one stalled a step
            "graph_capture_seconds": 0.0 if graphs is None else graphs.capture_s,
            # steps of a new shape run eagerly while a trainer in this process computed (capture_gate.py)
            "graph_captures_deferred": 0 if graphs is None else graphs.captures_deferred,
            "prefix_cache": {"queries": self.scheduler.pool.stats.queries, "hits": self.scheduler.pool.stats.hits},
            # how prompt chunks attend: packed for FlashAttention's variable-length kernel, or padded
            "prompt_attention": "flash_varlen" if self.runner.varlen_prompts else "padded",
            # what /init_weight_transfer_engine accepts here ("ipc": JSON handles, same GPU only)
            "weight_transfer_backends": ["nccl", "gloo", "ipc"] if s.device.type == "cuda" else ["gloo"],
            "pid": os.getpid(),  # a trainer sees whether the server runs in its own process (ServerThread)
        }
        steps = request.query.get("steps")
        if steps is not None:  # the last N steps, oldest first (EngineStats.recent)
            if not steps.isdigit():
                raise P.ApiError(400, f"steps must be a whole number of recent steps to list, got {steps!r}")
            recent = list(st.recent)[-int(steps):] if int(steps) else []
            embedded["recent_steps"] = [dataclasses.asdict(r) for r in recent]
        fmt = request.query.get("config_format", "text")
        return _json({
            "vllm_config": config if fmt == "json" else json.dumps(config),
            "vllm_env": {}, "system_env": {}, "embedded": embedded,
        })

    async def world_size(self, request: web.Request) -> web.Response:
        return _json({"world_size": 1})

    async def is_paused(self, request: web.Request) -> web.Response:
        return _json({"is_paused": self.engine.pause_mode is not None})

    async def pause(self, request: web.Request) -> web.Response:
        mode = request.query.get("mode", "abort")
        try:
            if mode not in ("abort", "wait", "keep"):
                raise ValueError(f"mode must be one of abort, wait, keep; got {mode!r}")
            clear_cache = _query_bool(request, "clear_cache", True)
            lease_s = _query_seconds(request, "lease_s")
        except ValueError as exc:
            return _json({"error": str(exc)}, 400)
        await self.engine.pause(mode, clear_cache)
        self.leases.paused(lease_s)  # an embedded-server extension; vLLM's clients get --trainer-lease
        return _json({"status": "paused"})

    async def resume(self, request: web.Request) -> web.Response:
        if self.transfer.active and not await self._holder_alive():  # its sender is gone: never finishes
            await self.abandon_transfer()
        await self.engine.resume()
        self.leases.resumed()
        return _json({"status": "resumed"})

    async def abort_requests(self, request: web.Request) -> web.Response:
        try:
            body = await self._body(request, required=False)
        except P.ApiError as exc:
            return _json({"error": exc.message}, 400)
        ids = body.get("request_ids") or None
        if ids is not None and not (isinstance(ids, list) and all(isinstance(i, str) for i in ids)):
            return _json({"error": "request_ids must be a list of strings"}, 400)
        return _json({"status": "aborted", "aborted": await self.engine.abort(ids)})

    async def reset_prefix_cache(self, request: web.Request) -> web.Response:
        """As vLLM: forget every cached prefix; fails while requests hold KV blocks unless
        reset_running_requests=true, which preempts them (they re-prefill later)."""
        try:
            reset_running = _query_bool(request, "reset_running_requests", False)
        except ValueError as exc:
            return _json({"error": str(exc)}, 400)

        def reset() -> bool:
            success, num_preempted = self.scheduler.reset_prefix_cache(reset_running)
            self.engine.stats.num_preemptions += num_preempted
            return success

        return _json({"success": await self.engine.call(reset)})

    async def weight_info(self, request: web.Request) -> web.Response:
        return _json({"weight_version": self.engine.weight_version})

    async def weight_checksum(self, request: web.Request) -> web.Response:
        """An embedded-server extension (vLLM has no such route): the digest of every served parameter
        (`asyncgrpo.sync.checksum`), taken between engine steps so that no update is half applied."""

        def digests() -> tuple[str, dict[str, str]]:
            params = self.served.model.named_parameters(remove_duplicate=False)
            return self.engine.weight_version, weights_checksum(params)

        version, tensors = await self.engine.call(digests)
        return _json({"weight_version": version, "algorithm": "sha256", "tensors": tensors})

    async def init_transfer(self, request: web.Request) -> web.Response:
        """One init at a time, on its own thread, bounded by --weight-transfer-timeout; a second one while
        it runs is refused (409) rather than queued, so inits aimed at a dead address pile up nowhere."""
        body = await self._body(request)
        if self._init_started is not None:
            raise P.ApiError(
                409,
                f"a weight-transfer init is already in progress (started {time.monotonic() - self._init_started:.0f} s "
                f"ago; it succeeds or fails within {self.transfer.timeout_s:.0f} s); retry after it ends",
            )
        self._init_started = time.monotonic()
        try:
            await self.admit_init(request)
        except BaseException:
            self._init_started = None
            raise
        init_info = body.get("init_info")
        fut = in_daemon_thread(lambda: self.transfer.init(init_info), "asyncgrpo-weight-init")
        fut.add_done_callback(lambda _: setattr(self, "_init_started", None))  # when the init ends, not the request
        with self.metrics.operation("init"):
            await self._unless_stopping(fut)
        self.leases.hold(trainer_id(request), request.remote)
        return _json({"message": "Weight transfer initialized"})

    async def _unless_stopping(self, fut: asyncio.Future) -> Any:
        """Await fut (shielded: it belongs to a thread) unless the server starts shutting down first:
        SIGTERM must not wait for an init that is stuck connecting."""
        stopping = asyncio.ensure_future(self.stopping.wait())
        try:
            await asyncio.wait({fut, stopping}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopping.cancel()
        if not fut.done():
            raise P.ApiError(503, "the server is shutting down")
        return fut.result()

    async def start_update(self, request: web.Request) -> web.Response:
        async with self.weight_call(request):
            with self.metrics.operation("start"):
                self.transfer.start()
        return _json({"message": "Weight update started"})

    async def update_weights(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        if "update_info" not in body:
            raise P.ApiError(400, "the body needs update_info", param="update_info")
        async with self.weight_call(request):
            with self.metrics.operation("update"):
                await self.engine.call(lambda: self._load_weights(body["update_info"]))
        return _json({"message": "Weights updated"})

    def _load_weights(self, update_info) -> int:
        """Engine thread: receive and load; cached prefixes of the old weights are dropped even when
        loading fails half way (some tensors may already have changed)."""
        try:
            return self.transfer.update(update_info)
        finally:
            self.scheduler.invalidate_prefix_cache()

    async def finish_update(self, request: web.Request) -> web.Response:
        body = await self._body(request, required=False)
        async with self.weight_call(request):
            with self.metrics.operation("finish"):
                self.transfer.finish()
                self._num_updates += 1
                version = body.get("weight_version")
                await self._set_version(str(version) if version is not None else str(self._num_updates))
        return _json({"message": "Weight update finished"})

    async def shutdown_transfer(self, request: web.Request) -> web.Response:
        async with self.weight_call(request):
            with self.metrics.operation("shutdown"):
                await asyncio.to_thread(self.transfer.shutdown)
        self.leases.release()
        return _json({"message": "Weight transfer shut down"})

    async def update_weight_version(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        version = body.get("new_version")
        if not isinstance(version, str):
            raise P.ApiError(400, "new_version must be a string", param="new_version")
        await self._set_version(version)
        return _json({"success": True, "new_version": version})

    async def _set_version(self, version: str) -> None:
        def apply() -> None:
            self.engine.weight_version = version

        await self.engine.call(apply)
