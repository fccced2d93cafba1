"""vLLM's profiling routes: the torch profiler over the engine thread, between two HTTP calls.

    POST /start_profile   the profiler starts in the engine thread, between two steps
    POST /stop_profile    it stops there, and (off the engine thread) a Chrome trace (`trace-<time>.json.gz`,
                          for Perfetto or chrome://tracing) and a table of the operators and kernels with
                          the most own time (`summary-<time>.txt`) are written to the profiler directory

The routes exist only when the server has a profiler directory (`--profiler-dir`, or vLLM's
`VLLM_TORCH_PROFILER_DIR`): profiling slows every step while it runs. The trace holds the engine
thread's operators and, on CUDA, every kernel of the device in that time.
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path
from typing import Any

import torch
from aiohttp import web

from asyncgrpo.server import protocol as P
from asyncgrpo.server.engine import Engine
from asyncgrpo.server.routes.common import RouteTable

logger = logging.getLogger(__name__)

SUMMARY_ROWS = 40


class EngineProfiler:
    """One torch profiler at a time; `start` and `stop` run in the engine thread."""

    def __init__(self, directory: str | Path, device: torch.device) -> None:
        self.directory = Path(directory)
        self.device = device
        self._profile: torch.profiler.profile | None = None

    def start(self) -> None:
        if self._profile is not None:
            raise P.ApiError(409, "the profiler is already running: POST /stop_profile first")
        self.directory.mkdir(parents=True, exist_ok=True)
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self._profile = torch.profiler.profile(activities=activities)
        self._profile.__enter__()
        logger.info("profiling the engine (POST /stop_profile writes the trace to %s)", self.directory)

    def stop(self) -> torch.profiler.profile:
        """End the profile (in the engine thread, between steps); `write` makes its files."""
        if self._profile is None:
            raise P.ApiError(409, "the profiler is not running: POST /start_profile first")
        profile, self._profile = self._profile, None
        if self.device.type == "cuda":
            # the last steps' kernels belong in the trace
            torch.cuda.current_stream(self.device).synchronize()
        profile.__exit__(None, None, None)
        return profile

    def write(self, profile: torch.profiler.profile) -> dict[str, Any]:
        """The trace and the summary table of an ended profile: seconds of work for a long one, done
        off the engine thread so that generation goes on meanwhile."""
        stamp = time.strftime("%Y%m%d-%H%M%S")
        trace = self.directory / f"trace-{stamp}.json.gz"
        summary = self.directory / f"summary-{stamp}.txt"
        profile.export_chrome_trace(str(trace))
        averages = profile.key_averages()
        sort_by = "self_device_time_total" if self.device.type == "cuda" else "self_cpu_time_total"
        summary.write_text(averages.table(sort_by=sort_by, row_limit=SUMMARY_ROWS) + "\n")
        logger.info("profile written: %s, %s", trace, summary)
        return {"trace": str(trace), "summary": str(summary), "num_events": len(profile.events())}


class ProfileRoutes(RouteTable):
    """POST /start_profile, /stop_profile over the engine's profiler."""

    ROUTES = (("POST", "/start_profile", "start_profile"), ("POST", "/stop_profile", "stop_profile"))

    def __init__(self, engine: Engine, profiler: EngineProfiler) -> None:
        self.engine = engine
        self.profiler = profiler

    async def start_profile(self, request: web.Request) -> web.Response:
        await self.engine.call(self.profiler.start)
        message = f"profiling; POST /stop_profile writes to {self.profiler.directory}"
        return web.json_response({"message": message})

    async def stop_profile(self, request: web.Request) -> web.Response:
        profile = await self.engine.call(self.profiler.stop)
        return web.json_response(await asyncio.to_thread(self.profiler.write, profile))
