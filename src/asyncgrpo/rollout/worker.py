"""The rollout process shell: spawn, environment scrub, health checks, stop escalation.

    trainer (rank 0)                              rollout process (spawned, CUDA-free)
    ----------------                              ------------------------------------
    RolloutWorker.start()  -- pickles -------->   run_rollout_process(loop_cls, loop_kwargs, channel)
                                                    loop = build_loop(loop_cls, loop_kwargs, channel)
                                                    asyncio.run(loop.run())
    check_health()        <-- failed_event,  ---   any exception: WorkerError on channel.errors,
                              errors, heartbeat     failed_event set, exit code 1
    stop(timeout)         -- stop_event ------->   tasks cancelled, close() hook, exit code 0
                          then join -> terminate -> kill, by the pid this object started

Everything handed to the child is pickled (the process is spawned, not forked): `spawn_inputs.py`
checks it before the trainer starts anything.
"""

from __future__ import annotations

import inspect
import logging
import multiprocessing as mp
import os
import queue
import signal
import sys
import time
import traceback
from typing import Any

from asyncgrpo.parent_watch import exit_with_parent
from asyncgrpo.rollout.channel import ROLLOUT_PROCESS_NAME, RolloutChannel, WorkerError
from asyncgrpo.rollout.spawn_inputs import check_spawn_inputs, main_module_hidden

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

def _unreported_exit(exitcode: int) -> str:
    """How a child that reported no error ended, in words."""
    if exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = f"signal {-exitcode}"
        oom = " (SIGKILL from nobody you know of is most often the out-of-memory killer: see `dmesg`)"
        return f"was killed by {name}{oom if name == 'SIGKILL' else ''}."
    return (f"exited with code {exitcode} before it could report an error: it failed while starting "
            "(importing the modules of what it was handed) or outside its error handling; its traceback is "
            "in the output above.")


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


# What the trainer passes beyond the reference's `AsyncRolloutLoop.__init__` arguments.
_TRAINER_ONLY_ARGS = ("dataset_skip_positions", "expects_pushed_weights")


def build_loop(loop_cls: type, loop_kwargs: dict[str, Any], channel: RolloutChannel) -> Any:
    """`loop_cls` constructed with `channel=` when its `__init__` takes it (or `**kwargs`); otherwise -- a
    subclass that overrides `__init__` with the reference's signature -- with the channel's primitives one by
    one, the rest of the channel and the trainer-only arguments handed over after construction."""
    params = inspect.signature(loop_cls).parameters
    if "channel" in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return loop_cls(**loop_kwargs, channel=channel)
    kwargs = {**loop_kwargs, **channel.reference_primitives()}
    extras = {name: kwargs.pop(name) for name in _TRAINER_ONLY_ARGS if name in kwargs and name not in params}
    loop = loop_cls(**kwargs)
    loop._join_pipeline(channel, **extras)
    return loop


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
        level=logging.INFO, format="%(asctime)s rollout %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    exit_code = 0
    reported: list[BaseException] = []

    def on_failure(exc: BaseException) -> None:  # called before the loop's shutdown and close()
        _report_error(channel, exc)
        reported.append(exc)

    try:
        loop = build_loop(loop_cls, loop_kwargs, channel)
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
        needs_main = check_spawn_inputs(self.loop_cls, self.loop_kwargs)
        ctx = mp.get_context("spawn")
        process = ctx.Process(
            target=run_rollout_process,
            args=(self.loop_cls, self.loop_kwargs, self.channel, os.getpid()),
            name=ROLLOUT_PROCESS_NAME,
            daemon=True,
        )
        updates = _scrubbed_environ_updates()
        saved = {key: os.environ.get(key) for key in updates}
        try:
            for key, value in updates.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value
            with main_module_hidden(not needs_main):
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
                    raise RuntimeError(
                        f"The rollout process (pid {process.pid}) reported a failure without details.")
                return
            raise RuntimeError(f"The rollout process (pid {process.pid}) {_unreported_exit(exitcode)}")
        last_beat = max(self.channel.heartbeat.value, self._started_at)
        age = time.time() - last_beat
        if age > self.heartbeat_timeout_s:
            raise TimeoutError(
                f"The rollout process (pid {process.pid}) has not sent a heartbeat for {age:.0f} s "
                f"(rollout_worker_timeout={self.heartbeat_timeout_s:g}): its event loop is blocked, e.g. by "
                "a loop hook doing blocking work instead of awaiting it. Raise rollout_worker_timeout if "
                "this is expected."
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
            logger.warning("rollout process (pid %d) ignored the stop request for %.0f s; terminating it",
                           process.pid, timeout)
            process.terminate()
            process.join(terminate_timeout)
        if process.is_alive():
            logger.warning("rollout process (pid %d) survived SIGTERM; killing it", process.pid)
            process.kill()
            process.join(10.0)
        return process.exitcode
