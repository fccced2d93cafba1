"""`GenerationClient`: the project's only HTTP client of the inference server (vLLM or the embedded
server). Async, one `aiohttp.ClientSession` per client, one client per process. The session, the
retry mechanism and its errors are `ServerTransport` (transport.py); this module holds the routes and
chooses, per call kind, what a request retries on:

    call kind                          retried on                          else
    generate                           connection errors, timeouts, 5xx    4xx -> ServerRequestError at once
    info / metrics / pause / resume    connection errors, 5xx              timeout -> TimeoutError
    weight-transfer routes             never (a half-done transfer cannot  any error raises at once
                                       be repeated by HTTP alone)
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp

from asyncgrpo.generation.protocol import (
    COMPLETIONS_PATH,
    GENERATE_PATH,
    INITIAL_WEIGHT_VERSION,
    ProtocolError,
    SamplingParams,
    TurnOutput,
    build_completions_request,
    build_generate_request,
    error_message,
    expect_field,
    parse_completions_response,
    parse_generate_response,
)
from asyncgrpo.generation.server_info import (
    ServerInfo,
    ServerMetrics,
    parse_metrics,
    parse_models,
    parse_server_info,
    parse_version,
    parse_world_size,
)
from asyncgrpo.generation.transport import (
    ServerConnectionError,
    ServerRequestError,
    ServerTransport,
    connection_failure,
)

logger = logging.getLogger(__name__)

PUSH_POLL_S = 1.0  # how often a generation waiting for pushed weights asks the server again


_CLIENT_ERRORS = frozenset(range(400, 500))
_STREAM_TRANSPORT_ERRORS = (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError)


class ServerRestartedError(RuntimeError):
    """The server serves weights no trainer pushed into it after a trainer had: it restarted (or was
    replaced) during training and lost the trained weights and the weight-transfer group, and the
    trainer could not push them again."""

    def __init__(self, base_url: str, seen: str) -> None:
        super().__init__(
            f"the inference server at {base_url} {seen} (weight version {INITIAL_WEIGHT_VERSION!r}, the "
            "weights it loaded at start): it restarted during training and lost the trained weights. Nothing "
            "it generated from them is trained on. Resume training from the last checkpoint "
            "(`trainer.train(resume_from_checkpoint=True)`): a run pushes its weights into the server before "
            "it generates"
        )
        self.base_url = base_url


class GenerationClient(ServerTransport):
    """Talks to one inference server at `base_url`. Call `start()` inside the event loop that will
    use it, then `detect()` (generation needs the server description), and `close()` at the end."""

    def __init__(
        self,
        base_url: str,
        *,
        timeout_s: float = 1800.0,
        api_key: str | None = None,
        max_retries: int = 5,
        backoff_s: float = 0.5,
        on_retry: Callable[[], None] | None = None,
        headers: dict[str, str] | None = None,
        outage_s: float = 0.0,
    ) -> None:
        """outage_s: `vllm_server_restart_timeout`, how long requests wait for a server that stopped
        answering to come back (0: `max_retries` only)."""
        super().__init__(base_url, timeout_s=timeout_s, api_key=api_key, max_retries=max_retries,
                         backoff_s=backoff_s, on_retry=on_retry, headers=headers, outage_s=outage_s)
        self.info: ServerInfo | None = None
        self._warned_top_logprobs = False
        # a trainer has pushed its weights: base-model tokens from the server's initial weights mean it
        # restarted, and are asked again once the trainer has pushed its weights back (see generate)
        self.expects_pushed_weights = False
        self._push_wait: asyncio.Lock | None = None  # one waiter polls the server at a time
        self._said_restart = False

    # ---------------------------------------------------------------------------------- detection

    async def detect(self) -> ServerInfo:
        """Describe the server (version, model, context, log-prob mode, routes) and cache it in
        `self.info`. Warns when log-probs are not `processed_logprobs`."""
        version, dialect = parse_version(await self._get_json("/version"))
        model_name, max_model_len = parse_models(await self._get_json("/v1/models"))
        status, text = await self._request(
            "GET", "/server_info", params={"config_format": "json"}, pass_statuses=frozenset({404})
        )
        config = parse_server_info(self._json("/server_info", text)) if status == 200 else None
        status, text = await self._request(
            "GET", "/get_world_size", params={"include_dp": "true"}, pass_statuses=frozenset({404})
        )
        world_size = parse_world_size(self._json("/get_world_size", text)) if status == 200 else None
        status, _ = await self._request("GET", "/metrics", pass_statuses=frozenset({404}))
        has_metrics = status == 200
        supports_generate = await self._probe_generate(model_name)
        info = ServerInfo(
            version=version,
            dialect=dialect,
            model_name=model_name,
            max_model_len=max_model_len
            if max_model_len is not None or config is None
            else config.max_model_len,
            dtype=config.dtype if config else None,
            logprobs_mode=config.logprobs_mode if config else None,
            supports_generate=supports_generate,
            supports_sampling_mask=bool(config and config.return_sampling_mask and supports_generate),
            has_metrics=has_metrics,
            kv_cache_tokens=config.kv_cache_tokens if config else None,
            world_size=world_size,
            dev_mode=config is not None,
            lora=config.lora if config else None,
            device=config.device if config else None,
        )
        if info.logprobs_mode is not None and info.logprobs_mode != "processed_logprobs":
            logger.warning(
                "the server returns %s; the importance ratio needs the sampled distribution: start vLLM with "
                "--logprobs-mode processed_logprobs",
                info.logprobs_mode,
            )
        if not info.dev_mode:
            logger.warning(
                "%s has no /server_info: the RL routes (pause, weight transfer) are off; start vLLM with "
                "VLLM_SERVER_DEV_MODE=1",
                self.base_url,
            )
        logger.info(
            "server %s: version %s, model %s, max_model_len %s, generate route %s, sampling masks %s",
            self.base_url,
            version,
            model_name,
            info.max_model_len,
            supports_generate,
            info.supports_sampling_mask,
        )
        self.info = info
        return info

    async def _probe_generate(self, model_name: str) -> bool:
        """The token-in/token-out route exists unless a one-token request answers 404/403."""
        params = SamplingParams(temperature=1.0, top_k=1, max_tokens=1, seed=0, logprobs=None)
        body = build_generate_request([0], params, dialect=(0, 0, 0))
        status, _ = await self._request(
            "POST", GENERATE_PATH, json_body=body, pass_statuses=frozenset({400, 403, 404})
        )
        return status not in (403, 404)

    # ---------------------------------------------------------------------------------- generation

    async def generate(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        *,
        request_id: str | None = None,
        model: str | None = None,
    ) -> TurnOutput:
        """Generate one turn from token ids. Uses /inference/v1/generate when the server has it,
        else /v1/completions. `model` selects a LoRA adapter by name (default: the base model).

        With `expects_pushed_weights`, a base-model turn that came, in part, from the server's initial
        weights (it restarted) is dropped and asked again once the server serves pushed weights, which
        the trainer pushes back when it finds the restart (`_wait_for_pushed_weights`). Servers without
        `weight_versions` (before vLLM 0.32) are not checked; adapter requests are not either: their base
        weights stay the initial ones."""
        while True:
            out = await self._generate_once(prompt_ids, params, request_id=request_id, model=model)
            initial = any(span.version == INITIAL_WEIGHT_VERSION for span in out.weight_versions or ())
            if not (self.expects_pushed_weights and model is None and initial):
                return out
            await self._wait_for_pushed_weights()

    async def _wait_for_pushed_weights(self) -> None:
        """Until the server serves pushed weights again (`/weight_info`), at most `timeout_s`; then
        `ServerRestartedError`. Said once per restart; one waiter polls at a time, the others find it done."""
        if self._push_wait is None:
            self._push_wait = asyncio.Lock()
        async with self._push_wait:
            deadline = time.monotonic() + self.timeout_s
            while True:
                try:
                    version = await self.weight_info()
                except (ServerRequestError, ProtocolError) as exc:  # no /weight_info to wait on
                    raise ServerRestartedError(
                        self.base_url, "generated tokens with weights no trainer pushed"
                    ) from exc
                if version != INITIAL_WEIGHT_VERSION:
                    if self._said_restart:
                        logger.warning("the inference server at %s serves pushed weights again (%s): "
                                       "generation goes on", self.base_url, version)
                        self._said_restart = False
                    return
                if not self._said_restart:
                    logger.warning(
                        "the inference server at %s generated tokens with its initial weights (%r): it "
                        "restarted and lost the trained weights. Those tokens are dropped; waiting up to "
                        "%.0f s for the trainer to push its weights again",
                        self.base_url, INITIAL_WEIGHT_VERSION, self.timeout_s,
                    )
                    self._said_restart = True
                if time.monotonic() > deadline:
                    raise ServerRestartedError(
                        self.base_url, f"has served weights no trainer pushed for {self.timeout_s:.0f} s"
                    )
                await asyncio.sleep(PUSH_POLL_S)

    async def _generate_once(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        *,
        request_id: str | None,
        model: str | None,
    ) -> TurnOutput:
        info = self.info or await self.detect()
        if params.return_sampling_mask and not info.supports_sampling_mask:
            raise ValueError(
                "candidate sets (top_k/top_p/min_p) need a server that returns sampling masks; "
                f"{self.base_url} does not: start vLLM >= 0.28 with --return-sampling-mask "
                "--enable-scale-out (VLLM_USE_V2_MODEL_RUNNER=1 if it refuses the flag)"
            )
        if info.supports_sampling_mask and (params.temperature <= 0 or params.top_k <= 0):
            raise ValueError(
                "the server runs with --return-sampling-mask, which rejects requests unless temperature > 0 "
                f"and top_k > 0 (got temperature={params.temperature}, top_k={params.top_k}); set top_k (and "
                "temperature > 0) or restart the server without --return-sampling-mask"
            )
        k = params.logprobs
        if info.supports_generate:
            body = build_generate_request(
                prompt_ids, params, dialect=info.dialect, request_id=request_id, model=model
            )
            data = await self._post_json(GENERATE_PATH, body, retry_timeout=True)
            out = parse_generate_response(data, num_top_logprobs=k)
            if params.return_sampling_mask and out.sampling_mask is None:
                raise ProtocolError(f"{GENERATE_PATH}: sampling masks were needed but the response has none")
            return out
        body = build_completions_request(
            prompt_ids,
            params,
            model=model or info.model_name,
            max_model_len=info.max_model_len,
            request_id=request_id,
        )
        data = await self._post_json(COMPLETIONS_PATH, body, retry_timeout=True)
        out = parse_completions_response(data, num_top_logprobs=k)
        if k and out.top_logprobs is None and not self._warned_top_logprobs:
            self._warned_top_logprobs = True
            logger.warning(
                "/v1/completions keys top log-probs by token text, which cannot be mapped back to ids; "
                "top_logprobs are unavailable (start vLLM with --enable-scale-out for the token-id route, or "
                "--return-tokens-as-token-ids)"
            )
        return out

    async def openai_request(self, path: str, body: dict[str, Any]) -> tuple[int, Any]:
        """POST one OpenAI-compatible request (`/v1/chat/completions`, `/v1/completions`) as a harness's
        recording proxy forwards it: (status, JSON body). A 4xx comes back as it is, for the harness to see;
        transport errors, 5xx and timeouts are retried as a generation request's."""
        status, text = await self._request(
            "POST", path, json_body=body, retry_timeout=True, pass_statuses=_CLIENT_ERRORS
        )
        try:
            return status, json.loads(text)
        except ValueError:
            return status, {"error": {"message": text[:2000], "type": "BadRequestError", "code": status}}

    async def openai_stream(
        self, path: str, body: dict[str, Any], on_event: Callable[[dict[str, Any]], Awaitable[None]]
    ) -> tuple[int, Any]:
        """POST one streaming OpenAI-compatible request (`"stream": true`) and await `on_event(chunk)` for
        each server-sent event until `[DONE]`: (status, None), or a 4xx's (status, JSON body) with no event.
        A connection that fails before the first event is tried again (up to `max_retries`); one that
        fails after it, a 5xx and a timeout raise (`ServerConnectionError`, `ServerRequestError`,
        `TimeoutError`)."""
        if self._session is None:
            raise RuntimeError(f"{type(self).__name__}.start() must be awaited before making requests")
        url = self.base_url + path
        sent = [0]  # events handed to on_event so far

        async def counted(event: dict[str, Any]) -> None:
            sent[0] += 1
            await on_event(event)

        attempt = 0
        while True:
            try:
                return await self._stream_once(url, path, body, counted)
            except asyncio.TimeoutError as exc:
                raise TimeoutError(f"POST {url} (stream) did not end within {self.timeout_s:.0f}s; raise "
                                   "`vllm_server_timeout` if the server is just slow") from exc
            except _STREAM_TRANSPORT_ERRORS as exc:
                if sent[0] or attempt >= self.max_retries:
                    raise ServerConnectionError(
                        f"POST {url} (stream) failed: {connection_failure(exc)}"
                    ) from exc
                attempt += 1
                await asyncio.sleep(min(self.backoff_s * 2 ** (attempt - 1), 5.0))

    async def _stream_once(
        self, url: str, path: str, body: dict[str, Any], on_event: Callable[[dict[str, Any]], Awaitable[None]]
    ) -> tuple[int, Any]:
        timeout = aiohttp.ClientTimeout(total=self.timeout_s)
        async with self._session.post(url, json=body, timeout=timeout) as resp:
            if resp.status >= 400:
                text = await resp.text()
                if resp.status >= 500:
                    raise ServerRequestError("POST", path, resp.status, error_message(text))
                try:
                    return resp.status, json.loads(text)
                except ValueError:
                    return resp.status, {"error": {"message": text[:2000], "code": resp.status}}
            buffer = b""
            async for data in resp.content.iter_any():  # events may be longer than a line limit
                *events, buffer = (buffer + data).split(b"\n\n")
                for event in events:
                    payload = event.strip()
                    if not payload.startswith(b"data:"):
                        continue
                    payload = payload[5:].strip()
                    if payload == b"[DONE]":
                        return resp.status, None
                    await on_event(json.loads(payload))
            return resp.status, None

    async def answers(self, timeout_s: float = 2.0) -> bool:
        """Whether GET /health answers 200 within `timeout_s`: one attempt, no retry (is a server that
        stopped answering back?)."""
        try:
            status, _ = await self._request("GET", "/health", timeout_s=timeout_s, retry_transient=False,
                                            pass_statuses=frozenset(range(400, 600)))
        except (ServerConnectionError, TimeoutError):
            return False
        return status == 200

    async def metrics(self) -> ServerMetrics | None:
        """Parsed /metrics, or None when the server has no such route."""
        status, text = await self._request("GET", "/metrics", pass_statuses=frozenset({404}))
        return parse_metrics(text) if status == 200 else None

    # ---------------------------------------------------------------------------------- RL control

    async def pause(self, mode: str = "keep", clear_cache: bool = True, lease_s: float | None = None) -> None:
        """POST /pause; returns once the server reports the pause complete (`mode` keep|wait|abort).
        `lease_s` (embedded server only; vLLM ignores it): the pause ends by itself unless renewed
        within that many seconds (0: never; None: the server's --trainer-lease)."""
        if mode not in ("keep", "wait", "abort"):
            raise ValueError(f"pause mode must be 'keep', 'wait' or 'abort', got {mode!r}")
        params = {"mode": mode, "clear_cache": "true" if clear_cache else "false"}
        if lease_s is not None:
            params["lease_s"] = repr(float(lease_s))
        expect_field(await self._post_json("/pause", params=params), "status", "paused", "/pause")

    async def resume(self) -> None:
        expect_field(await self._post_json("/resume"), "status", "resumed", "/resume")

    async def is_paused(self) -> bool:
        body = await self._get_json("/is_paused")
        if not isinstance(body, dict) or not isinstance(body.get("is_paused"), bool):
            raise ProtocolError(f"/is_paused: expected {{'is_paused': bool}}, got {body!r}")
        return body["is_paused"]

    async def lease(self) -> dict[str, Any] | None:
        """The embedded server's trainer lease (`GET /lease`: holder, whether it is alive, `message` when
        another trainer holds the server); None from a server without the route (vLLM)."""
        status, text = await self._request("GET", "/lease", pass_statuses=frozenset({404}))
        if status == 404:
            return None
        body = self._json("/lease", text)
        if not isinstance(body, dict) or not isinstance(body.get("lease_s"), (int, float)):
            raise ProtocolError(f"/lease: expected {{'lease_s': float, ...}}, got {body!r}")
        return body

    async def release_hold(self, timeout_s: float = 5.0) -> bool:
        """Give the embedded server back at once if this client holds it (`GET /lease` says so): POST
        /shutdown_weight_transfer_engine drops its weight-transfer group and its hold, so the next trainer
        need not wait out the lease. One attempt per request, `timeout_s` each. False when there was
        nothing to release (another holder, none, or vLLM, which has no lease)."""
        status, text = await self._request("GET", "/lease", pass_statuses=frozenset({404}),
                                           retry_transient=False, timeout_s=timeout_s)
        if status == 404 or not (isinstance(body := self._json("/lease", text), dict)
                                 and body.get("is_holder")):
            return False
        await self._post_json("/shutdown_weight_transfer_engine", retry_transient=False, timeout_s=timeout_s)
        return True

    async def renew_lease(self, timeout_s: float) -> bool:
        """Renew this client's hold on the embedded server (and its pause); one attempt, no retry."""
        body = await self._post_json("/renew_lease", retry_transient=False, timeout_s=timeout_s)
        return bool(isinstance(body, dict) and body.get("renewed"))

    async def get_world_size(self) -> int:
        """Number of server workers (TP * PP * DP) that join the weight-transfer group."""
        return parse_world_size(await self._get_json("/get_world_size", params={"include_dp": "true"}))

    async def weight_info(self) -> str:
        """The server's current weight version (`"default"` before any update)."""
        body = await self._get_json("/weight_info")
        if not isinstance(body, dict) or not isinstance(body.get("weight_version"), str):
            raise ProtocolError(f"/weight_info: expected {{'weight_version': str}}, got {body!r}")
        return body["weight_version"]

    async def weight_checksum(self) -> dict[str, str]:
        """{parameter name: digest} of the served weights (`asyncgrpo.sync.checksum`). The embedded
        server answers it; vLLM has no such route (404)."""
        body = await self._get_json("/weight_checksum")
        tensors = body.get("tensors") if isinstance(body, dict) else None
        if not isinstance(tensors, dict):
            raise ProtocolError(f"/weight_checksum: expected {{'tensors': {{name: digest}}}}, got {body!r}")
        return tensors

    # ---------------------------------------------------------------------------------- LoRA adapters

    async def load_lora_adapter(self, name: str, path: str) -> None:
        """POST /v1/load_lora_adapter: the server reads the PEFT adapter at `path` (a path it can
        see) and serves it as model `name`. A refusal raises `ServerRequestError` with vLLM's message;
        a load is not retried (a 5xx here is the adapter's fault, not a transient one)."""
        await self._request("POST", "/v1/load_lora_adapter", json_body={"lora_name": name, "lora_path": path},
                            retry_transient=False)

    async def unload_lora_adapter(self, name: str) -> bool:
        """POST /v1/unload_lora_adapter; False when the server does not know `name` (404)."""
        status, _ = await self._request("POST", "/v1/unload_lora_adapter", json_body={"lora_name": name},
                                        retry_transient=False, pass_statuses=frozenset({404}))
        return status != 404

    async def served_adapters(self) -> list[str]:
        """The names of the LoRA adapters the server has loaded (the /v1/models cards with a parent)."""
        body = await self._get_json("/v1/models")
        cards = body.get("data") if isinstance(body, dict) else None
        if not isinstance(cards, list):
            raise ProtocolError(f"/v1/models: expected {{'data': [cards]}}, got {json.dumps(body)[:300]}")
        return [str(c["id"]) for c in cards if isinstance(c, dict) and c.get("parent")]

    # ---------------------------------------------------------------------------------- weight transfer

    async def _weight_call(self, path: str, body: Any = None) -> dict[str, Any]:
        reply = await self._post_json(path, body, retry_transient=False, retry_timeout=False)
        if not isinstance(reply, dict):
            raise ProtocolError(f"{path}: expected a JSON object, got {reply!r}")
        return reply

    async def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> dict[str, Any]:
        """Blocks until every server worker joined the transfer group (run it concurrently with the
        trainer's own group init)."""
        return await self._weight_call("/init_weight_transfer_engine", {"init_info": init_info})

    async def start_weight_update(self) -> dict[str, Any]:
        return await self._weight_call("/start_weight_update")

    async def update_weights(self, update_info: dict[str, Any]) -> dict[str, Any]:
        """Blocks until the workers received and loaded the tensors (run it concurrently with the
        broadcast)."""
        return await self._weight_call("/update_weights", {"update_info": update_info})

    async def finish_weight_update(self, weight_version: str | None = None) -> dict[str, Any]:
        body = {"weight_version": weight_version} if weight_version is not None else None
        return await self._weight_call("/finish_weight_update", body)

    async def shutdown_weight_transfer_engine(self) -> dict[str, Any]:
        """vLLM >= 0.33: tear down the transfer group (e.g. after a failed transfer) before re-init."""
        return await self._weight_call("/shutdown_weight_transfer_engine")
