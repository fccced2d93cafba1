"""Say what a long wait is waiting for, within seconds, and again while it lasts.

A wait bounded by a long timeout (the server at start-up: `vllm_server_timeout`, 30 minutes by
default) would otherwise be silent for all of it. A daemon thread logs `describe(seconds so far)` after
`first_after_s`, then every `every_s`, until the block ends.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

logger = logging.getLogger(__name__)


@contextmanager
def notice_while_waiting(
    describe: Callable[[float], str], *, first_after_s: float = 2.0, every_s: float = 60.0
) -> Iterator[None]:
    start = time.monotonic()
    done = threading.Event()
    noticed = threading.Event()

    def notice() -> None:
        delay = first_after_s
        while not done.wait(delay):
            logger.warning(describe(time.monotonic() - start))
            noticed.set()
            delay = every_s

    thread = threading.Thread(target=notice, name="asyncgrpo-wait-notice", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join(timeout=1.0)
    if noticed.is_set():
        logger.info("the wait ended after %.0f s", time.monotonic() - start)
