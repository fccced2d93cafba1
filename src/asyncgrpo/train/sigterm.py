"""SIGTERM stops training the way Ctrl-C does, instead of making the process vanish mid-step.

A scheduler's preemption, `kill PID` or a container stop sends SIGTERM. Python's default is to die at
once, skipping every `finally`: the rollout process then dies with its parent, but the embedded server
keeps this trainer's hold (and pause, if a push was under way) until `--trainer-lease` runs out, and
multiprocessing reports leaked semaphores. While `train()` runs, SIGTERM instead raises `SystemExit(143)`
in the main thread, so `train()`'s clean-up runs (the server resumed and given back, the rollout process
stopped); a second SIGTERM kills at once. A handler the user installed is left alone.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
from collections.abc import Iterator

logger = logging.getLogger(__name__)

EXIT_CODE = 128 + signal.SIGTERM  # what a shell reports for a process SIGTERM ended


@contextlib.contextmanager
def sigterm_stops_training() -> Iterator[None]:
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGTERM) not in (
        signal.SIG_DFL, None,
    ):
        yield
        return

    def stop(signum, frame) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a second SIGTERM kills at once
        logger.warning("SIGTERM: stopping training (the rollout process, the server's hold); send it again "
                       "to kill at once")
        raise SystemExit(EXIT_CODE)

    signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        if signal.getsignal(signal.SIGTERM) is stop:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
