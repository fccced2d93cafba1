"""Weight transfer from the trainer to the inference server (vllm-protocol.md section 5).

    packed.py        pure: update metadata, chunk plan (strict `t > B`), pack/unpack bytes
    delta.py         pure: weight deltas (the changed words) and the sketch that checks their result
    communicator.py  the `Communicator` interface both communicators offer, and `in_daemon_thread`
    nccl.py          ctypes NCCL communicator (vLLM, or the embedded server on GPU)
    gloo.py          standalone gloo communicator (the embedded server on CPU)
    sender.py        trainer side: `WeightSender` (HTTP handshake + broadcast), rank 0
    receiver.py      server side: `WeightReceiver` (joins the group, yields received tensors)
    ipc_sender.py    trainer side of the CUDA IPC transfer: `IpcSender` (one shared buffer, chunk by chunk)
    ipc.py           the IPC wire forms (JSON handles, vLLM's pickled ones) and the server side

Sender and receiver run the same layout code over either communicator. Both sides join their group
from `in_daemon_thread`. On the trainer, the transports of `asyncgrpo.train.weights` own the senders
(`collective.py`, `ipc.py`) and pause the server around them.
"""

from __future__ import annotations

from typing import Any

from asyncgrpo.sync.communicator import Communicator, in_daemon_thread

__all__ = ["Communicator", "WeightReceiver", "WeightSender", "in_daemon_thread"]


def __getattr__(name: str) -> Any:
    if name == "WeightSender":
        from asyncgrpo.sync.sender import WeightSender

        return WeightSender
    if name == "WeightReceiver":
        from asyncgrpo.sync.receiver import WeightReceiver

        return WeightReceiver
    raise AttributeError(f"module 'asyncgrpo.sync' has no attribute {name!r}")
