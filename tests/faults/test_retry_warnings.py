"""When the server dies under many concurrent requests, the client's retry warnings are rate-limited:
one line per interval carrying how many retries it stands for, not one line per retry (item 9)."""

from __future__ import annotations

import asyncio
import logging
import socket

import pytest

from asyncgrpo.generation.client import GenerationClient
from asyncgrpo.generation.protocol import SamplingParams
from asyncgrpo.generation.server_info import ServerInfo
from asyncgrpo.generation.transport import ServerConnectionError


def _dead_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


def test_two_hundred_failing_requests_log_a_few_counted_lines(caplog):
    async def run() -> list[BaseException]:
        client = GenerationClient(_dead_url(), max_retries=3, backoff_s=0.01, timeout_s=5)
        client.info = ServerInfo(version="0.33.0", dialect=(0, 33, 0), model_name="m",
                                 max_model_len=64, dtype=None,
                                 logprobs_mode=None, supports_generate=True, supports_sampling_mask=False,
                                 has_metrics=False, kv_cache_tokens=None, world_size=1)
        params = SamplingParams(temperature=1.0, top_k=0, max_tokens=2, seed=0, logprobs=None)
        await client.start()
        try:
            return await asyncio.gather(*(client.generate([1, 2], params) for _ in range(200)),
                                        return_exceptions=True)
        finally:
            await client.close()

    with caplog.at_level(logging.WARNING, logger="asyncgrpo.generation.transport"):
        errors = asyncio.run(run())
    # every request still fails, after retries
    assert all(isinstance(e, ServerConnectionError) for e in errors)
    lines = [r.getMessage() for r in caplog.records]
    assert 2 <= len(lines) <= 4, lines  # 600 retries in well under the 10 s interval, and the count at close
    assert "retry 1/3" in lines[0]
    shown = len(lines) - 1
    assert lines[-1].startswith(f"{600 - shown} more retries not shown"), lines


@pytest.mark.parametrize("n", [1])
def test_a_single_retry_is_still_logged_at_once(caplog, n):
    async def run() -> None:
        client = GenerationClient(_dead_url(), max_retries=n, backoff_s=0.01, timeout_s=5)
        await client.start()
        try:
            with pytest.raises(ServerConnectionError, match="after 1 retries"):
                await client.metrics()
        finally:
            await client.close()

    with caplog.at_level(logging.WARNING, logger="asyncgrpo.generation.transport"):
        asyncio.run(run())
    assert len(caplog.records) == 1 and "GET /metrics failed" in caplog.records[0].getMessage()
