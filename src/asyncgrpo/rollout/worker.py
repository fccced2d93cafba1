"""The rollout process shell: spawn, environment scrub, health checks, stop escalation.

    trainer (rank 0)                              rollout process (spawned, CUDA-free)
    ----------------                              ------------------------------------
    RolloutWorker.start()  -- pickles -------->   run_rollout_process(loop_cls, loop_kwargs, channel)
                                                    loop = loop_cls(**loop_kwargs, channel=channel)
                                                    asyncio.run(loop.run())
    check_health()        <-- failed_event,  ---   any exception: WorkerError on channel.errors,
                              errors, heartbeat     failed_event set, exit code 1
    stop(timeout)         -- stop_event ------->   tasks cancelled, close() hook, exit code 0
                          then join -> terminate -> kill, by the pid this object started

Everything handed to the child is pickled (the process is spawned, not forked), so the trainer calls
`check_picklable` on each user object before spawning: a lambda or closure then fails at once with
a `TypeError` that names it instead of deep inside `Process.start()`.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import os
import pickle
import queue
import sys
import time
import traceback
from collections.abc import Iterator, Mapping
from typing import Any

from asyncgrpo.parent_watch import exit_with_parent
from asyncgrpo.rollout.channel import ROLLOUT_PROCESS_NAME, RolloutChannel, WorkerError

logger = logging.getLogger(__name__)

# Variables that make a child process believe it is a torchrun rank (and try to join the group).
_TORCHRUN_VARS = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "ROLE_RANK",
    "ROLE_WORLD_SIZE",
    "GROUP_WORLD_SIZE",
)
_TORCHRUN_PREFIXES = ("TORCHELASTIC_",)

_PICKLE_ADVICE = (
    "the rollout process is spawned, so everything handed to it is pickled: use a module-level "
    "function, functools.partial or a callable class instance"
)


def check_picklable(obj: Any, what: str) -> None:
    """Raise `TypeError` naming `what` when `obj` cannot be pickled for the spawned rollout process.

    `what` is how the user knows the object, e.g. "reward_funcs[1]" or "environment_factory".
    """
    try:
        pickle.dumps(obj)
    except Exception as exc:  # pickle raises PicklingError, AttributeError or TypeError
        name = getattr(obj, "__name__", None) or type(obj).__name__
        raise TypeError(f"{what} ({name}) cannot be pickled: {exc}; {_PICKLE_ADVICE}.") from exc


def _user_objects(loop_cls: type, loop_kwargs: Mapping[str, Any]) -> Iterator[tuple[str, Any]]:
    """(how the user knows it, object) for everything user-supplied that the child unpickles."""
    yield "loop_cls", loop_cls
    for i, func in enumerate(loop_kwargs.get("reward_funcs") or []):
        yield f"reward_funcs[{i}]", func
    for i, tool in enumerate(loop_kwargs.get("tools") or []):
        yield f"tools[{i}]", tool
    factory = loop_kwargs.get("environment_factory")
    if isinstance(factory, Mapping):
        for name, item in factory.items():
            yield f"environment_factory[{name!r}]", item
    elif factory is not None:
        yield "environment_factory", factory
    if loop_kwargs.get("config") is not None:
        yield "config", loop_kwargs["config"]


def check_loop_inputs_picklable(loop_cls: type, loop_kwargs: Mapping[str, Any]) -> None:
    """Pickle the loop class and each user-supplied callable of `loop_kwargs` separately.

    Checks `reward_funcs[i]`, `tools[i]`, `environment_factory` (or each entry of a dict of
    factories) and `config`, so the error names the one object that fails.
    """
    for what, obj in _user_objects(loop_cls, loop_kwargs):
        check_picklable(obj, what)


def _needs_main_module(loop_cls: type, loop_kwargs: Mapping[str, Any]) -> bool:
    """Whether something handed to the child is defined in the launching script (`__main__`)."""
    return any(b"__main__" in pickle.dumps(obj) for _, obj in _user_objects(loop_cls, loop_kwargs))


@contextlib.contextmanager
def _main_module_hidden(hide: bool) -> Iterator[None]:
    """Keep the spawned child from re-running the launching script when nothing needs it.

    A spawned child imports the parent's `__main__` script so that objects defined there unpickle;
    a script that trains at import time (no `if __name__ == "__main__":`) would then train again in
    the child. When no object comes from `__main__`, the child is told there is no main script.
    """
    main = sys.modules.get("__main__")
    if not hide or main is None:
        yield
        return
    saved = {name: main.__dict__[name] for name in ("__file__", "__spec__") if name in main.__dict__}
    main.__dict__.pop("__file__", None)
    main.__dict__["__spec__"] = None
    try:
        yield
    finally:
        main.__dict__.pop("__spec__", None)
        main.__dict__.update(saved)


def _scrubbed_environ_updates() -> dict[str, str | None]:
    """The environment changes for the child: no GPU, no torchrun rank variables (None = unset)."""
    updates: dict[str, str | None] = {"CUDA_VISIBLE_DEVICES": ""}
    for key in os.environ:
        if key in _TORCHRUN_VARS or key.startswith(_TORCHRUN_PREFIXES):
            updates[key] = None
    return updates


def _report_error(channel: RolloutChannel, exc: BaseException) -> None:
    """Put the exception with its formatted traceback on the channel and mark the worker failed."""
    formatted = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    try:
        channel.errors.put(WorkerError(type(exc).__name__, str(exc), formatted))
    finally:
        channel.failed_event.set()


def run_rollout_process(
    loop_cls: type, loop_kwargs: dict[str, Any], channel: RolloutChannel, parent_pid: int | None = None
) -> None:
    """Entry point of the spawned process: build the loop, run it, report any failure.

    Exits with code 0 after a requested stop and 1 after an error (reported on `channel.errors`).
    With `parent_pid` (the trainer's), it also exits as soon as that process is gone.
    """
    import asyncio

    if parent_pid is not None:
        exit_with_parent(parent_pid)

    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s rollout %(levelname)s %(name)s: %(message)s", stream=sys.stderr
    )
    exit_code = 0
    reported: list[BaseException] = []

    def on_failure(exc: BaseException) -> None:  # called before the loop's shutdown and close()
        _report_error(channel, exc)
        reported.append(exc)

    try:
        loop = loop_cls(**loop_kwargs, channel=channel)
        asyncio.run(loop.run(on_failure=on_failure))
    except BaseException as exc:  # noqa: BLE001 -- reported to the trainer, then the process exits 1
        if reported:
            exit_code = 1
        elif not (isinstance(exc, (KeyboardInterrupt, SystemExit)) and channel.stop_event.is_set()):
            _report_error(channel, exc)
            exit_code = 1
    # Samples and metrics nobody will read must not keep the process alive at exit; the error queue
    # is flushed (its feeder thread is joined) so the traceback reaches the trainer.
    for q in (channel.samples, channel.metrics):
        q.cancel_join_thread()
    if exit_code:
        sys.exit(exit_code)


class RolloutWorker:
    """Owns one spawned rollout process: starts it, checks its health, stops it.

    `loop_kwargs` are the `AsyncRolloutLoop` constructor arguments except `channel`; the loop is
    constructed inside the child. `heartbeat_timeout_s` defaults to `config.rollout_worker_timeout`.
    """

    def __init__(
        self,
        loop_cls: type,
        loop_kwargs: dict[str, Any],
        channel: RolloutChannel,
        *,
        heartbeat_timeout_s: float | None = None,
    ) -> None:
        self.loop_cls = loop_cls
        self.loop_kwargs = dict(loop_kwargs)
        self.channel = channel
        if heartbeat_timeout_s is None:
            heartbeat_timeout_s = float(self.loop_kwargs["config"].rollout_worker_timeout)
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self._process: mp.process.BaseProcess | None = None
        self._started_at = 0.0
        self._stop_requested = False
        self._error: WorkerError | None = None

    @property
    def pid(self) -> int | None:
        return None if self._process is None else self._process.pid

    def is_alive(self) -> bool:
        return self._process is not None and self._process.is_alive()

    def start(self) -> None:
        """Check picklability, then spawn the child with a CUDA-free, torchrun-free environment."""
        assert self._process is None, "RolloutWorker.start() called twice"
        check_loop_inputs_picklable(self.loop_cls, self.loop_kwargs)
        ctx = mp.get_context("spawn")
        process = ctx.Process(
            target=run_rollout_process,
            args=(self.loop_cls, self.loop_kwargs, self.channel, os.getpid()),
            name=ROLLOUT_PROCESS_NAME,
            daemon=True,
        )
        updates = _scrubbed_environ_updates()
        saved = {key: os.environ.get(key) for key in updates}
        hide_main = not _needs_main_module(self.loop_cls, self.loop_kwargs)
        try:
            for key, value in updates.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value
            with _main_module_hidden(hide_main):
                process.start()
        finally:
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value
        self._process = process
        self._started_at = time.time()
        logger.info("rollout process started (pid %d)", process.pid)

    def _child_error(self, wait_s: float) -> WorkerError | None:
        """The first error the child reported, waiting up to `wait_s` for it to arrive."""
        if self._error is None:
            try:
                self._error = self.channel.errors.get(timeout=wait_s)
            except queue.Empty:
                return None
        return self._error

    def check_health(self) -> None:
        """Raise if the rollout process failed, died, or stopped beating; return quietly otherwise.

        Raises `RuntimeError` carrying the child's traceback when it reported an error or exited,
        and `TimeoutError` when its heartbeat is older than `rollout_worker_timeout`.
        """
        process = self._process
        if process is None:
            raise RuntimeError("The rollout process was never started: call RolloutWorker.start() first.")
        exitcode = process.exitcode
        if self.channel.failed_event.is_set() or exitcode is not None:
            error = self._child_error(wait_s=5.0 if self.channel.failed_event.is_set() else 0.5)
            if error is not None:
                raise RuntimeError(
                    f"The rollout process failed with {error.type_name}: {error.message}\n\n"
                    f"Traceback from the rollout process (pid {process.pid}):\n{error.traceback}"
                )
            if exitcode is None or (exitcode == 0 and self._stop_requested):
                # failed_event without a message (should not happen) or a clean requested exit.
                if exitcode is None:
                    raise RuntimeError(f"The rollout process (pid {process.pid}) reported a failure without details.")
                return
            raise RuntimeError(
                f"The rollout process (pid {process.pid}) exited with code {exitcode} without reporting an "
                "error (killed by a signal or out of memory?); see its log above."
            )
        last_beat = max(self.channel.heartbeat.value, self._started_at)
        age = time.time() - last_beat
        if age > self.heartbeat_timeout_s:
            raise TimeoutError(
                f"The rollout process (pid {process.pid}) has not sent a heartbeat for {age:.0f} s "
                f"(rollout_worker_timeout={self.heartbeat_timeout_s:g}): its event loop is blocked, e.g. by a loop "
                "hook doing blocking work instead of awaiting it. Raise rollout_worker_timeout if this is expected."
            )

    def stop(self, timeout: float = 30.0, *, terminate_timeout: float = 5.0) -> int | None:
        """Stop the child: set stop_event and join up to `timeout` s, then SIGTERM and join up to
        `terminate_timeout` s, then SIGKILL. Returns its exit code (negative: the signal that ended it)."""
        process = self._process
        if process is None:
            return None
        self._stop_requested = True
        self.channel.stop_event.set()
        process.join(timeout)
        if process.is_alive():
            logger.warning("rollout process (pid %d) ignored the stop request for %.0f s; terminating it", process.pid, timeout)
            process.terminate()
            process.join(terminate_timeout)
        if process.is_alive():
            logger.warning("rollout process (pid %d) survived SIGTERM; killing it", process.pid)
            process.kill()
            process.join(10.0)
        return process.exitcode
