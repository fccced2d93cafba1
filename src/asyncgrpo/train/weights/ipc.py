"""The CUDA IPC transport: a trainer on the server's own GPU, where NCCL cannot connect the two. It owns
`asyncgrpo.sync.ipc_sender.IpcSender` (the wire forms are in `asyncgrpo.sync.ipc`) and is paused like
the collective transport:

    init()   POST /init_weight_transfer_engine {"backend": "ipc", "packed": true}  (vLLM: {"packed": true})
    send()   link.while_paused:  POST /pause?mode=keep
                                 IpcSender.push: start / update_weights per chunk (a buffer shared by
                                 handle, copied by the server before it replies) / finish
                                 POST /resume
    close()  drop the shared buffer

`dialect` "embedded" (the embedded server: JSON handles) or "vllm" (vLLM 0.33 started with the ipc
weight-transfer backend, which unpickles the handles: `INSECURE_RISK`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from asyncgrpo.sync.packed import DEFAULT_BUFFER_SIZE_BYTES, TensorMeta
from asyncgrpo.train.server_link import ServerLink
from asyncgrpo.train.weights.base import FullWeights
from asyncgrpo.train.weights.gather import NamedTensors

VLLM_IPC_RESTART = (
    "VLLM_ALLOW_INSECURE_SERIALIZATION=1 VLLM_SERVER_DEV_MODE=1 vllm serve MODEL "
    "--weight-transfer-config '{\"backend\": \"ipc\"}' --gpu-memory-utilization 0.4 ..."
)
"""How to start vLLM so that a trainer on its GPU can push weights (the ipc backend)."""
INSECURE_RISK = (
    "vLLM's ipc backend unpickles the handles it receives, so with VLLM_ALLOW_INSECURE_SERIALIZATION=1 "
    "anyone who can reach the server's port can run code in it: bind it to 127.0.0.1 (the default) on a "
    "trusted host"
)


class IpcTransport(FullWeights):
    """CUDA IPC on the server's own GPU, `dialect` "embedded" or "vllm" (module docstring)."""

    def __init__(self, link: ServerLink, device: torch.device, dtype: torch.dtype, dialect: str,
                 *, bucket_bytes: int = DEFAULT_BUFFER_SIZE_BYTES) -> None:
        from asyncgrpo.sync.ipc_sender import IpcSender

        super().__init__(dtype, bucket_bytes)
        self.link = link
        self.sender = IpcSender(link.client, device=torch.device(device), dialect=dialect,
                                buffer_size_bytes=bucket_bytes)

    def init(self) -> None:
        self.link.run(self.sender.init())

    def send(self, named_tensors: NamedTensors, *, label: str,
             metas: Sequence[TensorMeta] | None = None) -> dict[str, float]:
        if metas is None:  # the sender announces every chunk before it copies it: it needs the metas first
            tensors = list(named_tensors)
            metas = [TensorMeta.of(name, tensor) for name, tensor in tensors]
            named_tensors = iter(tensors)
        return self.link.while_paused(lambda: self.sender.push(named_tensors, version=label, metas=metas))

    def close(self) -> None:
        if self.link.is_open():
            self.link.run(self.sender.close(), timeout_s=30)

    def __str__(self) -> str:
        return f"IpcTransport({self.sender.dialect})"
