"""What a harness is and how one run of it goes: a callable (sync or async) or a command.

    HarnessRun (base_url, api_key, model, prompt, row)  --run_harness-->  HarnessOutcome
                                                                          (reward, or why it failed)

A harness is the user's agent, written against the OpenAI API: it gets a base URL and an API key of
its own for one rollout, calls the model as often as it likes, and returns a reward (or None, when the
trainer's `reward_funcs` score the recorded conversation instead).

- A callable, `harness(run: HarnessRun) -> float | None`, sync or `async def`. A sync one runs in a
  thread of the rollout process; an async one on its event loop (it must not block it).
- A command (`HarnessCommand`, or a string / list of strings): run as a subprocess with the rollout's
  endpoint in `OPENAI_BASE_URL` / `OPENAI_API_KEY` (what the `openai` SDK reads), the model name in
  `OPENAI_MODEL`, the prompt's messages as JSON in `ASYNCGRPO_PROMPT` and its dataset row in
  `ASYNCGRPO_ROW`. It gives its reward by writing a number to the file named by `ASYNCGRPO_REWARD_FILE`
  (nothing written: None); a non-zero exit status is a failure.

A run that raises, returns something else than a number or None, exits non-zero or outlives its
timeout is a failure (`HarnessOutcome.failure`), never an exception: the rollout loop counts and
reports it. On timeout a command is killed (its whole process group) and an async harness cancelled;
a sync harness's thread cannot be stopped, it runs on until it returns, and its calls are refused.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import math
import os
import signal
import tempfile
import traceback
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Any

FAILED, TIMEOUT, NO_CALL = "failed", "timeout", "no_call"
_STDERR_TAIL = 2000


@dataclass(frozen=True)
class HarnessRun:
    """What one harness run gets: its endpoint and its task.

    Attributes:
        base_url: The OpenAI-compatible base URL of this rollout (ends with `/v1`).
        api_key: The key that endpoint takes (`Authorization: Bearer <api_key>`).
        model: The model name to send (any name is served by the trained model).
        prompt: The dataset row's prompt messages: the task.
        row: The whole dataset row (e.g. an answer column for the harness's own reward).
        rollout_id: This rollout's id, as in its training samples.
        group_id: The group (prompt) the rollout belongs to.
    """

    base_url: str
    api_key: str
    model: str
    prompt: list[dict[str, Any]]
    row: dict[str, Any] = field(default_factory=dict)
    rollout_id: str = ""
    group_id: int = 0

    def environment(self) -> dict[str, str]:
        """The variables a command harness gets."""
        return {
            "OPENAI_BASE_URL": self.base_url,
            "OPENAI_API_KEY": self.api_key,
            "OPENAI_MODEL": self.model,
            "ASYNCGRPO_PROMPT": json.dumps(self.prompt, default=str),
            "ASYNCGRPO_ROW": json.dumps(self.row, default=str),
            "ASYNCGRPO_ROLLOUT_ID": self.rollout_id,
        }


@dataclass(frozen=True)
class HarnessCommand:
    """A harness run as a subprocess, once per rollout.

    Attributes:
        argv: The command and its arguments (no shell).
        env: Extra environment variables (the rollout process's environment and the run's come too).
        cwd: Working directory; None: the rollout process's.
    """

    argv: tuple[str, ...]
    env: Mapping[str, str] = field(default_factory=dict)
    cwd: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.argv, str) or not self.argv or not all(isinstance(a, str) for a in self.argv):
            raise TypeError(f"HarnessCommand.argv must be a non-empty sequence of strings, got {self.argv!r}")
        object.__setattr__(self, "argv", tuple(self.argv))
        object.__setattr__(self, "env", dict(self.env))


Harness = Callable[[HarnessRun], Any] | HarnessCommand


def as_harness(harness: Any) -> Harness:
    """`harness` as a callable or a `HarnessCommand`; a string is split like a shell line (`shlex`), a list
    of strings is an argv. `TypeError` naming what to pass otherwise."""
    import shlex

    if isinstance(harness, HarnessCommand):
        return harness
    if isinstance(harness, str):
        return HarnessCommand(tuple(shlex.split(harness)))
    if isinstance(harness, Sequence) and harness and all(isinstance(a, str) for a in harness):
        return HarnessCommand(tuple(harness))
    if callable(harness):
        return harness
    raise TypeError(
        f"harness must be a callable taking a HarnessRun (sync or async), a command (a string, a list of "
        f"strings or a HarnessCommand), got {type(harness).__name__}"
    )


@dataclass(frozen=True)
class HarnessOutcome:
    """How one run ended: `reward` (None: none given) when `failure` is None; else FAILED or TIMEOUT and
    `detail`, the cause as the warning tells it."""

    reward: float | None = None
    failure: str | None = None
    detail: str = ""


async def run_harness(
    harness: Harness, run: HarnessRun, *, timeout_s: float, executor: Executor | None
) -> HarnessOutcome:
    """Run `harness` once for `run`, at most `timeout_s` seconds; never raises but for cancellation."""
    try:
        if isinstance(harness, HarnessCommand):
            return await _run_command(harness, run, timeout_s)
        if _is_async(harness):
            value = await asyncio.wait_for(harness(run), timeout_s)
        else:
            future = asyncio.get_running_loop().run_in_executor(executor, harness, run)
            value = await asyncio.wait_for(future, timeout_s)
            if inspect.isawaitable(value):
                value = await asyncio.wait_for(value, timeout_s)
    except asyncio.TimeoutError:
        return HarnessOutcome(failure=TIMEOUT, detail=f"still running after harness_timeout={timeout_s:g} s")
    except Exception as exc:  # noqa: BLE001 -- a harness's failure is its rollout's outcome, never the run's
        where = traceback.extract_tb(exc.__traceback__)[-1] if exc.__traceback__ else None
        at = f" (at {os.path.basename(where.filename)}:{where.lineno})" if where else ""
        return HarnessOutcome(failure=FAILED, detail=f"raised {type(exc).__name__}: {exc}{at}")
    return _reward_outcome(value, "returned")


def _is_async(func: Callable[..., Any]) -> bool:
    return inspect.iscoroutinefunction(func) or inspect.iscoroutinefunction(type(func).__call__)


def _reward_outcome(value: Any, how: str) -> HarnessOutcome:
    if value is None:
        return HarnessOutcome()
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return HarnessOutcome(failure=FAILED, detail=f"{how} {value!r} ({type(value).__name__}); a harness "
                              "gives a float reward, or None to leave scoring to reward_funcs")
    if not math.isfinite(value):
        return HarnessOutcome(failure=FAILED,
                              detail=f"{how} the reward {value}; rewards must be finite (or None)")
    return HarnessOutcome(reward=float(value))


async def _run_command(command: HarnessCommand, run: HarnessRun, timeout_s: float) -> HarnessOutcome:
    fd, reward_path = tempfile.mkstemp(prefix="asyncgrpo-reward-", suffix=".txt")
    os.close(fd)
    env = {**os.environ, **command.env, **run.environment(), "ASYNCGRPO_REWARD_FILE": reward_path}
    try:
        try:
            process = await asyncio.create_subprocess_exec(
                *command.argv, env=env, cwd=command.cwd, stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE, start_new_session=True,
            )
        except OSError as exc:
            return HarnessOutcome(failure=FAILED, detail=f"could not start {command.argv[0]!r}: {exc}")
        try:
            _, stderr = await asyncio.wait_for(process.communicate(), timeout_s)
        except (asyncio.TimeoutError, asyncio.CancelledError) as exc:
            _kill_group(process.pid)
            with contextlib.suppress(Exception):
                await asyncio.wait_for(process.wait(), 5.0)
            if isinstance(exc, asyncio.CancelledError):
                raise
            return HarnessOutcome(failure=TIMEOUT,
                                  detail=f"still running after harness_timeout={timeout_s:g} s; killed")
        if process.returncode != 0:
            tail = stderr.decode("utf-8", errors="replace").strip()[-_STDERR_TAIL:]
            return HarnessOutcome(failure=FAILED, detail=f"exited with status {process.returncode}"
                                  + (f"; its stderr ends with:\n{tail}" if tail else " (no stderr)"))
        text = (await asyncio.to_thread(_read_text, reward_path)).strip()
        if not text:
            return HarnessOutcome()
        try:
            value = float(text)
        except ValueError:
            return HarnessOutcome(failure=FAILED, detail=f"wrote {text[:200]!r} to ASYNCGRPO_REWARD_FILE; "
                                  "write a number (or nothing)")
        return _reward_outcome(value, "wrote")
    finally:
        with contextlib.suppress(OSError):
            os.unlink(reward_path)


def _read_text(path: str) -> str:
    with open(path) as f:
        return f.read()


def _kill_group(pid: int) -> None:
    """Kill the command and whatever it started (it leads its own session)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)
