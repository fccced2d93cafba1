"""Weight transfer from the trainer to the inference server (vllm-protocol.md section 5).

    packed.py        pure: update metadata, chunk plan (strict `t > B`), pack/unpack bytes
    communicator.py  the `Communicator` interface both communicators offer, and `in_daemon_thread`
    nccl.py          ctypes NCCL communicator (vLLM, or the embedded server on GPU)
    gloo.py          standalone gloo communicator (the embedded server on CPU)
    sender.py        trainer side: `WeightSender` (HTTP handshake + broadcast), rank 0
    receiver.py      server side: `WeightReceiver` (joins the group, yields received tensors)

Sender and receiver run the same layout code over either communicator. Both sides join their group
from `in_daemon_thread`.
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
