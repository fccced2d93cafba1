"""A server inside a trainer's process (`serve.ServerThread`) and the trainer: when the engine may capture.

The engine thread captures a CUDA graph the first time it meets a step's shape (`step_graphs.py`). A
capture fails, and CUDA discards it, when another thread synchronizes the whole device meanwhile
("operation not permitted when stream is capturing"), whatever the capture mode: torch's inductor does
so when it times kernel configurations on a compiled graph's first run, in the trainer's forward or
backward (seen with a 1.7B trainer beside its server on an H100). So the trainer holds this gate while it
computes a micro-batch (`device_work`), and the engine captures only while the gate is free
(`capture_window`); a step of a new shape that meets a computing trainer runs eagerly, and its shape is
captured at a later step, in a gap between the trainer's micro-batches (its waits, optimizer steps and
weight syncs). A process without a server thread takes an uncontended lock per micro-batch.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

__all__ = ["capture_window", "device_work"]

# re-entrant: device work may nest in one thread; the engine thread's non-blocking acquire still fails
_GATE = threading.RLock()


@contextlib.contextmanager
def device_work() -> Iterator[None]:
    """Around this thread's GPU work that may synchronize the whole device (a training step with its
    compilation and autotuning): no graph capture starts meanwhile. Waits for a capture in progress
    (tens of milliseconds)."""
    with _GATE:
        yield


@contextlib.contextmanager
def capture_window() -> Iterator[bool]:
    """Yields True, holding the gate until the block ends, when no thread does device work; else False
    at once (the caller runs its step eagerly and tries to capture later)."""
    acquired = _GATE.acquire(blocking=False)
    try:
        yield acquired
    finally:
        if acquired:
            _GATE.release()
