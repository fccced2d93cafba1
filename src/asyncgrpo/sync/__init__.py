"""Weight transfer from the trainer to the inference server (vllm-protocol.md section 5).

    packed.py    pure: update metadata, chunk plan (strict `t > B`), pack/unpack bytes
    nccl.py      ctypes NCCL communicator (vLLM, or the embedded server on GPU)
    gloo.py      standalone gloo communicator (the embedded server on CPU)
    sender.py    trainer side: `WeightSender` (HTTP handshake + broadcast), rank 0
    receiver.py  server side: `WeightReceiver` (joins the group, yields received tensors)

Both communicators offer the `Communicator` interface below; sender and receiver run the same
layout code over either. Both sides join their group from `in_daemon_thread`.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch


class Communicator(Protocol):
    """A group with the trainer as rank 0. Collectives are in place; `synchronize` waits (bounded by
    the communicator's timeout) until every enqueued collective finished on this rank."""

    rank: int
    world_size: int

    def all_reduce_sum_(self, tensor: torch.Tensor) -> None: ...

    def broadcast_(self, tensor: torch.Tensor, src: int = 0) -> None: ...

    def synchronize(self) -> None: ...

    def close(self) -> None: ...


def __getattr__(name: str) -> Any:
    if name == "WeightSender":
        from asyncgrpo.sync.sender import WeightSender

        return WeightSender
    if name == "WeightReceiver":
        from asyncgrpo.sync.receiver import WeightReceiver

        return WeightReceiver
    raise AttributeError(f"module 'asyncgrpo.sync' has no attribute {name!r}")


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
