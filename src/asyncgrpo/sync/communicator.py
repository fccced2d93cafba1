"""What both sides of a transfer run over: the `Communicator` interface the NCCL and gloo
communicators offer, and `in_daemon_thread`, from which both sides join their group.

Sender and receiver import these from here, not from the package face (`asyncgrpo.sync`, which
re-exports them and loads the sender and receiver lazily), so no module imports the package that
imports it.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch

__all__ = ["Communicator", "in_daemon_thread"]


class Communicator(Protocol):
    """A group with the trainer as rank 0. Collectives are in place; `synchronize` waits (bounded by
    the communicator's timeout) until every enqueued collective finished on this rank."""

    rank: int
    world_size: int

    def all_reduce_sum_(self, tensor: torch.Tensor) -> None: ...

    def broadcast_(self, tensor: torch.Tensor, src: int = 0) -> None: ...

    def synchronize(self) -> None: ...

    def close(self) -> None: ...


def in_daemon_thread(fn: Callable[[], Any], name: str) -> asyncio.Future:
    """Run a blocking fn() on its own daemon thread; the returned future resolves in the running loop.
    Not the loop's default executor: a call stuck in a C++ connect must neither use up a shared pool
    nor hold the interpreter's exit (asyncio.run joins the default executor's threads)."""
    loop = asyncio.get_running_loop()
    fut = loop.create_future()

    def settle(result: Any, error: BaseException | None) -> None:
        if not fut.done():
            fut.set_exception(error) if error is not None else fut.set_result(result)

    def run() -> None:
        result, error = None, None
        try:
            result = fn()
        except BaseException as exc:  # noqa: BLE001 -- handed to the awaiting handler
            error = exc
        try:
            loop.call_soon_threadsafe(settle, result, error)
        except RuntimeError:  # the loop closed: the server is shutting down, nobody waits
            pass

    threading.Thread(target=run, name=name, daemon=True).start()
    return fut
