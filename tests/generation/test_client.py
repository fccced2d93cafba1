"""GenerationClient against a real HTTP peer: a tiny `aiohttp.web` server inside the test that
answers with real vLLM 0.33 bodies or with the failures under test."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest
from aiohttp import web

from asyncgrpo.generation.client import GenerationClient
from asyncgrpo.generation.protocol import SamplingParams, VersionSpan
from asyncgrpo.generation.transport import ServerConnectionError, ServerRequestError

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "vllm"
CASES = json.loads((FIXTURES / "protocol-0.33.0.json").read_text())
METRICS = (FIXTURES / "metrics-0.33.0.txt").read_text()


def run(coro: Awaitable) -> object:
    return asyncio.run(coro)


async def start_app(app: web.Application, port: int = 0) -> tuple[web.AppRunner, str]:
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", port)
    await site.start()
    host, bound = runner.addresses[0][:2]
    return runner, f"http://{host}:{bound}"


def vllm_app(
    *,
    generate: Callable | None = None,
    scale_out: bool = True,
    hits: dict | None = None,
    pause_delay_s: float = 0.0,
) -> web.Application:
    """Routes of a vLLM 0.33 dev-mode server answering with the captured bodies."""
    hits = hits if hits is not None else {}

    def fixed(case: str) -> Callable:
        async def handler(request: web.Request) -> web.Response:
            hits[request.path] = hits.get(request.path, 0) + 1
            return web.json_response(CASES[case]["response"], status=CASES[case]["status"])

        return handler

    async def metrics(request: web.Request) -> web.Response:
        return web.Response(text=METRICS)

    async def gen(request: web.Request) -> web.Response:
        body = await request.json()
        hits.setdefault("generate_bodies", []).append(body)
        if not scale_out:
            return web.json_response(
                {"error": {"message": "scale-out off", "type": "PermissionDeniedError", "code": 403}},
                status=403,
            )
        if generate is not None:
            return await generate(request, body)
        return web.json_response(CASES["generate"]["response"])

    async def health(request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def pause(request: web.Request) -> web.Response:
        hits.setdefault("pause_queries", []).append(dict(request.query))
        await asyncio.sleep(pause_delay_s)
        return web.json_response(CASES["pause_keep"]["response"])

    async def completions(request: web.Request) -> web.Response:
        hits.setdefault("completions_bodies", []).append(await request.json())
        return web.json_response(CASES["completions_tokens"]["response"])

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_get("/version", fixed("version"))
    app.router.add_get("/v1/models", fixed("models"))
    app.router.add_get("/server_info", fixed("server_info"))
    app.router.add_get("/get_world_size", fixed("get_world_size"))
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/is_paused", fixed("is_paused_1"))
    app.router.add_post("/pause", pause)
    app.router.add_post("/resume", fixed("resume"))
    app.router.add_post("/inference/v1/generate", gen)
    app.router.add_post("/v1/completions", completions)
    return app


def test_detect_and_generate_with_real_bodies():
    hits: dict = {}

    async def main():
        runner, url = await start_app(vllm_app(hits=hits))
        try:
            async with GenerationClient(url) as client:
                await client.wait_until_ready(5)
                info = await client.detect()
                params = SamplingParams(
                    top_k=20, top_p=0.9, max_tokens=8, seed=1, logprobs=5, return_sampling_mask=True
                )
                out = await client.generate([101, 2023], params, request_id="abc")
                metrics = await client.metrics()
                paused = await client.is_paused()
                await client.pause(mode="keep", clear_cache=False)
                await client.resume()
                return info, out, metrics, paused
        finally:
            await runner.cleanup()

    info, out, metrics, paused = run(main())
    assert hits["pause_queries"] == [{"mode": "keep", "clear_cache": "false"}]
    assert (info.version, info.dialect, info.model_name, info.max_model_len) == (
        "0.33.0",
        (0, 33, 0),
        "MODEL_DIR",
        1024,
    )
    assert (info.dtype, info.logprobs_mode, info.kv_cache_tokens, info.world_size) == (
        "bfloat16",
        "processed_logprobs",
        21653472,
        1,
    )
    assert info.supports_generate and info.supports_sampling_mask and info.has_metrics and info.dev_mode
    assert out.token_ids == CASES["generate"]["response"]["choices"][0]["token_ids"]
    assert out.weight_versions == [VersionSpan("default", 0, 8)] and len(out.sampling_mask) == 8
    assert all(len(t) == 5 for t in out.top_logprobs)
    sent = hits["generate_bodies"][-1]
    assert (
        sent["token_ids"] == [101, 2023] and sent["request_id"] == "abc" and sent["output_mode"] == "tokens"
    )
    assert sent["sampling_params"] == {
        "temperature": 1.0,
        "top_k": 20,
        "top_p": 0.9,
        "min_p": 0.0,
        "repetition_penalty": 1.0,
        "max_tokens": 8,
        "seed": 1,
        "logprobs": 5,
        "detokenize": False,
    }
    assert metrics.kv_cache_usage_frac == 0.0 and metrics.num_preemptions == 0.0
    assert paused is True


def test_completions_fallback_when_generate_route_is_off(caplog):
    hits: dict = {}

    async def main():
        runner, url = await start_app(vllm_app(scale_out=False, hits=hits))
        try:
            async with GenerationClient(url) as client:
                info = await client.detect()
                out = await client.generate([1, 2, 3], SamplingParams(top_k=20, logprobs=5))
                return info, out
        finally:
            await runner.cleanup()

    with caplog.at_level(logging.WARNING, logger="asyncgrpo.generation.client"):
        info, out = run(main())
    assert not info.supports_generate and not info.supports_sampling_mask
    assert out.token_ids == CASES["completions_tokens"]["response"]["choices"][0]["token_ids"]
    assert out.top_logprobs is None and out.sampling_mask is None
    assert "cannot be mapped back to ids" in caplog.text
    body = hits["completions_bodies"][-1]
    assert body["prompt"] == [1, 2, 3] and body["model"] == "MODEL_DIR"
    assert body["max_tokens"] == 1024 - 3 and body["return_token_ids"] is True


def test_sampling_mask_server_rejects_untruncated_requests_before_sending():
    hits: dict = {}

    async def main():
        runner, url = await start_app(vllm_app(hits=hits))
        try:
            async with GenerationClient(url) as client:
                await client.detect()
                probes = len(hits["generate_bodies"])
                with pytest.raises(ValueError, match="top_k > 0"):
                    await client.generate([1], SamplingParams(top_k=0))
                with pytest.raises(ValueError, match="top_k > 0"):
                    await client.generate([1], SamplingParams(temperature=0.0, top_k=5))
                return probes
        finally:
            await runner.cleanup()

    probes = run(main())
    assert len(hits["generate_bodies"]) == probes  # nothing was sent


def test_5xx_is_retried_with_backoff_and_counted():
    calls = {"n": 0}
    retries: list[int] = []

    async def flaky(request, body):
        if body.get("request_id") != "r":  # the detect probe
            return web.json_response(CASES["generate"]["response"])
        calls["n"] += 1
        if calls["n"] <= 2:
            return web.json_response(
                {"error": {"message": "busy", "type": "ServiceUnavailableError", "code": 503}}, status=503
            )
        return web.json_response(CASES["generate"]["response"])

    async def main():
        runner, url = await start_app(vllm_app(generate=flaky))
        try:
            async with GenerationClient(url, backoff_s=0.01, on_retry=lambda: retries.append(1)) as client:
                await client.detect()
                return await client.generate([1], SamplingParams(top_k=20, logprobs=0), request_id="r")
        finally:
            await runner.cleanup()

    out = run(main())
    assert calls["n"] == 3 and len(retries) == 2
    assert out.top_logprobs is None and len(out.logprobs) == 8


def test_5xx_gives_up_after_max_retries_with_the_server_message():
    calls = {"n": 0}

    async def handler(request):
        calls["n"] += 1
        return web.json_response({"error": "engine dead"}, status=500)

    async def main():
        app = web.Application()
        app.router.add_post("/resume", handler)
        runner, url = await start_app(app)
        try:
            async with GenerationClient(url, max_retries=2, backoff_s=0.01) as client:
                await client.resume()
        finally:
            await runner.cleanup()

    with pytest.raises(ServerRequestError, match="/resume -> HTTP 500: engine dead") as err:
        run(main())
    assert err.value.status == 500 and calls["n"] == 3


def test_4xx_is_not_retried_and_carries_the_body():
    calls = {"n": 0}
    retries: list[int] = []

    async def handler(request):
        calls["n"] += 1
        return web.json_response(
            {
                "error": {
                    "message": "This model's maximum context length is 1024 tokens",
                    "type": "BadRequestError",
                    "code": 400,
                }
            },
            status=400,
        )

    async def main():
        app = web.Application()
        app.router.add_post("/pause", handler)
        runner, url = await start_app(app)
        try:
            async with GenerationClient(url, backoff_s=0.01, on_retry=lambda: retries.append(1)) as client:
                await client.pause()
        finally:
            await runner.cleanup()

    with pytest.raises(ServerRequestError) as err:
        run(main())
    assert calls["n"] == 1 and retries == []
    assert (err.value.status, err.value.method, err.value.path) == (400, "POST", "/pause")
    assert "maximum context length is 1024" in str(err.value)


def test_weight_routes_are_never_retried():
    calls = {"n": 0}

    async def handler(request):
        calls["n"] += 1
        return web.json_response(
            {"error": {"message": "Weight transfer not configured", "type": "x", "code": 500}}, status=500
        )

    async def main():
        app = web.Application()
        app.router.add_post("/start_weight_update", handler)
        runner, url = await start_app(app)
        try:
            async with GenerationClient(url, backoff_s=0.01) as client:
                await client.start_weight_update()
        finally:
            await runner.cleanup()

    with pytest.raises(ServerRequestError, match="Weight transfer not configured"):
        run(main())
    assert calls["n"] == 1


def test_dev_route_404_names_the_flag():
    async def main():
        runner, url = await start_app(web.Application())
        try:
            async with GenerationClient(url) as client:
                await client.get_world_size()
        finally:
            await runner.cleanup()

    with pytest.raises(ServerRequestError, match="VLLM_SERVER_DEV_MODE=1"):
        run(main())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_connection_errors_are_retried_until_the_server_appears():
    port = _free_port()
    retries: list[int] = []

    async def main():
        async def late_start():
            await asyncio.sleep(0.4)
            return await start_app(vllm_app(), port=port)

        starter = asyncio.ensure_future(late_start())
        async with GenerationClient(
            f"http://127.0.0.1:{port}", backoff_s=0.1, on_retry=lambda: retries.append(1)
        ) as client:
            try:
                return await client.is_paused()
            finally:
                runner, _ = await starter
                await runner.cleanup()

    assert run(main()) is True
    assert len(retries) >= 1


@pytest.mark.parametrize("client_keepalive_s, retried", [(0.2, False), (30.0, True)])
def test_idle_connections_are_dropped_before_the_server_closes_them(monkeypatch, client_keepalive_s, retried):
    """A server that answers one request per connection and then closes on the next one, as vLLM's
    server does with a request that arrives when its 5 s keep-alive runs out. A client that keeps idle
    connections for less than the server does opens a fresh one and never meets the reset. (/pause is a
    POST: aiohttp itself resends only idempotent requests that meet a closed connection.)"""
    from asyncgrpo.generation import transport

    assert transport.KEEPALIVE_S < 5  # the shipped value is below vLLM's default keep-alive
    monkeypatch.setattr(transport, "KEEPALIVE_S", client_keepalive_s)
    retries: list[int] = []

    async def one_answer_per_connection(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")  # a bodiless POST
        body = b'{"status": "paused"}'
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nConnection: keep-alive\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        await writer.drain()
        try:
            await reader.readuntil(b"\r\n\r\n")  # a second request on this connection: closed unanswered
        except asyncio.IncompleteReadError:
            pass
        writer.transport.abort()

    async def main():
        server = await asyncio.start_server(one_answer_per_connection, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        try:
            async with GenerationClient(f"http://127.0.0.1:{port}", backoff_s=0.01,
                                        on_retry=lambda: retries.append(1)) as client:
                await client.pause()
                await asyncio.sleep(0.5)  # idle: longer than the client keeps a connection, or not
                await client.pause()
        finally:
            server.close()
            await server.wait_closed()

    run(main())
    assert bool(retries) is retried


def test_connection_errors_give_up_after_max_retries():
    port = _free_port()
    retries: list[int] = []

    async def main():
        async with GenerationClient(
            f"http://127.0.0.1:{port}", max_retries=2, backoff_s=0.01, on_retry=lambda: retries.append(1)
        ) as client:
            await client.is_paused()

    with pytest.raises(ServerConnectionError,
                       match=f"127.0.0.1:{port}/is_paused failed: connection refused") as err:
        run(main())
    assert len(retries) == 2
    assert ("(after 2 retries over" in str(err.value)
            and "start it again and resume training" in str(err.value))


def test_a_server_that_stays_away_longer_than_the_retries_is_waited_for_within_the_restart_window(caplog):
    """vllm_server_restart_timeout: past max_retries, connection errors are retried until the window ends
    (a supervisor restarting the server), polling at least every OUTAGE_POLL_S, and the log says so."""
    port = _free_port()
    retries: list[int] = []

    async def main():
        async def late_start():
            await asyncio.sleep(1.5)  # max_retries=2 at 0.01 s are spent long before
            return await start_app(vllm_app(), port=port)

        starter = asyncio.ensure_future(late_start())
        async with GenerationClient(f"http://127.0.0.1:{port}", max_retries=2, backoff_s=0.01, outage_s=10,
                                    on_retry=lambda: retries.append(1)) as client:
            try:
                return await client.is_paused()
            finally:
                runner, _ = await starter
                await runner.cleanup()

    with caplog.at_level(logging.WARNING, logger="asyncgrpo.generation.transport"):
        assert run(main()) is True
    assert len(retries) > 2
    assert "waiting up to vllm_server_restart_timeout=10s for it to come back" in caplog.text
    assert f"the inference server at http://127.0.0.1:{port} answers again" in caplog.text


def test_the_restart_window_ends_with_an_error_that_says_how_long_it_waited():
    port = _free_port()

    async def main():
        async with GenerationClient(f"http://127.0.0.1:{port}", max_retries=1, backoff_s=0.01,
                                    outage_s=0.5) as client:
            await client.is_paused()

    t0 = time.monotonic()
    with pytest.raises(ServerConnectionError) as err:
        run(main())
    assert 0.5 <= time.monotonic() - t0 < 5
    assert "vllm_server_restart_timeout=0.5s" in str(err.value)


def test_without_a_restart_window_the_error_names_the_setting():
    port = _free_port()

    async def main():
        async with GenerationClient(f"http://127.0.0.1:{port}", max_retries=1, backoff_s=0.01) as client:
            await client.is_paused()

    with pytest.raises(ServerConnectionError, match="set `vllm_server_restart_timeout`"):
        run(main())


def test_generation_timeouts_are_retried_but_control_timeouts_raise():
    calls = {"n": 0}

    async def slow_first(request, body):
        calls["n"] += 1
        if calls["n"] == 2:  # the first real request (after the detect probe) hangs
            await asyncio.sleep(1.0)
        return web.json_response(CASES["generate"]["response"])

    async def main():
        runner, url = await start_app(vllm_app(generate=slow_first, pause_delay_s=1.0))
        try:
            async with GenerationClient(url, timeout_s=0.3, backoff_s=0.01) as client:
                await client.detect()
                out = await client.generate([1], SamplingParams(top_k=20))
                with pytest.raises(TimeoutError, match="vllm_server_timeout"):
                    await client.pause()
                return out
        finally:
            await runner.cleanup()

    out = run(main())
    assert calls["n"] == 3 and len(out.token_ids) == 8


def test_readiness_timeout_names_the_url_and_knob():
    async def unhealthy(request):
        return web.Response(status=503)

    async def main():
        app = web.Application()
        app.router.add_get("/health", unhealthy)
        runner, url = await start_app(app)
        try:
            async with GenerationClient(url) as client:
                with pytest.raises(TimeoutError) as err:
                    await client.wait_until_ready(0.6)
                return url, str(err.value)
        finally:
            await runner.cleanup()

    url, message = run(main())
    assert url in message and "vllm_server_timeout" in message and "HTTP 503" in message


def test_readiness_timeout_when_nothing_listens():
    port = _free_port()

    async def main():
        async with GenerationClient(f"http://127.0.0.1:{port}") as client:
            await client.wait_until_ready(0.3)

    with pytest.raises(TimeoutError, match="vllm_server_timeout"):
        run(main())


def test_answers_asks_health_once_without_retrying():
    state = {"status": 200}

    async def health(request):
        return web.Response(status=state["status"])

    async def main():
        app = web.Application()
        app.router.add_get("/health", health)
        runner, url = await start_app(app)
        try:
            async with GenerationClient(url, backoff_s=5.0) as client:
                healthy = await client.answers()
                state["status"] = 503
                t0 = time.monotonic()
                unhealthy = await client.answers()
                return healthy, unhealthy, time.monotonic() - t0
        finally:
            await runner.cleanup()

    healthy, unhealthy, took_s = run(main())
    assert healthy and not unhealthy and took_s < 2  # a 503 is not retried

    async def nothing_listens():
        async with GenerationClient(f"http://127.0.0.1:{_free_port()}", backoff_s=5.0) as client:
            t0 = time.monotonic()
            return await client.answers(), time.monotonic() - t0

    answered, took_s = run(nothing_listens())
    assert not answered and took_s < 2
