"""Task supervision for the rollout loop: every task it starts is tracked, and the first failure wins.

    spawn(coro) --> task --done--> failed? -> `failure` holds its exception (first one only)
    wait(stop_event, task) --> returns when `task` is done or a stop is requested; raises the failure
    cancel_all() --> cancels what is still running and waits (bounded) for it to end

Waits poll with a short period so a stop request or a failed task is seen within a fraction of a
second, whichever task is blocked where.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any

POLL_S = 0.05
CANCEL_WAIT_S = 10.0


class TaskSupervisor:
    """The tasks of one event loop; create it inside the running loop."""

    def __init__(self) -> None:
        self.failure: asyncio.Future = asyncio.get_running_loop().create_future()
        self._tasks: set[asyncio.Task] = set()  # started and not done

    def spawn(self, coro: Coroutine[Any, Any, Any], name: str) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        task.add_done_callback(self._on_done)
        return task

    def _on_done(self, task: asyncio.Task) -> None:
        if task.cancelled():
            return
        exc = task.exception()
        if exc is not None and not self.failure.done():
            self.failure.set_exception(exc)

    async def wait(self, stop_event: Any, task: asyncio.Task | None = None) -> None:
        """Until `task` (if any) is done or `stop_event` is set; raises the first task failure."""
        while True:
            if self.failure.done():
                self.failure.result()
            if stop_event.is_set() or (task is not None and task.done()):
                return
            await asyncio.sleep(POLL_S)

    async def cancel_all(self) -> None:
        tasks = [t for t in self._tasks if not t.done()]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=CANCEL_WAIT_S)
