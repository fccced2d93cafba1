"""A child process ends with the process that started it, however that one ends.

`watch_parent` is the shared mechanism (a daemon thread polling `os.getppid()`: POSIX re-parents an
orphan, so a changed parent pid means the parent is gone); the embedded server uses it to shut down
cleanly when its launcher dies, the rollout process through `exit_with_parent`:

A trainer killed with SIGKILL runs no cleanup, so its rollout process (and, through the pipe the child
keeps open, multiprocessing's resource tracker) would live on, polling the server forever. Two layers:

- Linux: `prctl(PR_SET_PDEATHSIG, SIGKILL)`; the kernel kills this process the moment its parent
  thread exits. The trainer spawns it from the thread that runs `train()` and stops it before
  `train()` returns, so that thread outlives it.
- everywhere: a daemon thread polling `os.getppid()`; POSIX re-parents an orphan, so a changed parent
  pid means the trainer is gone. It then exits hard (nothing in this process is worth saving: the
  only reader of its queues is dead).

Once this process is gone the resource tracker sees its pipe close and exits as well.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable

logger = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def _set_parent_death_signal(sig: int) -> bool:
    """Ask the Linux kernel to send `sig` when the parent dies; False where unavailable."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_PDEATHSIG, sig, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def watch_parent(parent_pid: int, on_gone: Callable[[], None], poll_s: float = 0.5) -> threading.Thread:
    """Call `on_gone()` from a daemon thread once `parent_pid` is no longer this process's parent."""

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(poll_s)
        on_gone()

    thread = threading.Thread(target=watch, name="asyncgrpo-parent-watch", daemon=True)
    thread.start()
    return thread


def exit_with_parent(parent_pid: int, poll_s: float = 0.5) -> threading.Thread:
    """Make this process end hard when `parent_pid` (its parent) ends; returns the watchdog thread."""
    _set_parent_death_signal(signal.SIGKILL)
    if os.getppid() != parent_pid:  # the parent died before the signal was armed
        os._exit(1)

    def gone() -> None:
        logger.warning("the trainer (pid %d) is gone; the rollout process exits", parent_pid)
        os._exit(1)

    return watch_parent(parent_pid, gone, poll_s)
