"""The collective transport: the server's weight-transfer group, over NCCL from a CUDA trainer or gloo
from a CPU one (vllm-protocol.md section 5). It owns rank 0's `asyncgrpo.sync.sender.WeightSender`;
`ServerLink` gives it the HTTP client, its event loop and the pause.

    init()   WeightSender.init: GET /get_world_size, POST /init_weight_transfer_engine || join the group
    send()   link.while_paused:  POST /pause?mode=keep
                                 WeightSender.push: start / update_weights || broadcast chunks / finish
                                 POST /resume
    close()  leave the group (`init()` forms a new one: what restart recovery does)

NCCL refuses two ranks on one GPU: a trainer on the server's GPU gets an error naming CUDA IPC
(`ipc.py`), which `choose.py` picks by itself when it knows the two share a GPU.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from asyncgrpo.sync.packed import DEFAULT_BUFFER_SIZE_BYTES, TensorMeta
from asyncgrpo.train.server_link import ServerLink
from asyncgrpo.train.weights.base import FullWeights
from asyncgrpo.train.weights.gather import NamedTensors
from asyncgrpo.train.weights.ipc import INSECURE_RISK, VLLM_IPC_RESTART


class CollectiveTransport(FullWeights):
    """Rank 0 of the server's weight-transfer group; `backend` "nccl" or "gloo" (default: NCCL from a
    CUDA `device`, gloo from the CPU). `device` is where the chunks are packed and sent from."""

    def __init__(self, link: ServerLink, device: torch.device, dtype: torch.dtype, backend: str | None = None,
                 *, bucket_bytes: int = DEFAULT_BUFFER_SIZE_BYTES) -> None:
        super().__init__(dtype, bucket_bytes)
        self.link = link
        self.device = torch.device(device)
        self.backend = backend or ("nccl" if self.device.type == "cuda" else "gloo")
        self.sender = None  # the WeightSender, while the group is formed

    def init(self) -> None:
        """Form the group (raises with the fix when NCCL refuses it)."""
        from asyncgrpo.sync.sender import WeightSender

        self.sender = WeightSender(self.link.client, backend=self.backend, device=self.device,
                                   buffer_size_bytes=self.bucket_bytes, timeout_s=self.link.timeout_s)
        try:
            self.link.run(self.sender.init())
        except RuntimeError as exc:
            hint = nccl_failure_hint(str(exc)) if self.backend == "nccl" else None
            if hint is None:
                raise
            raise RuntimeError(f"{exc}\n{hint}") from exc

    def send(self, named_tensors: NamedTensors, *, label: str,
             metas: Sequence[TensorMeta] | None = None) -> dict[str, float]:
        """Pause (keep), broadcast, resume (`ServerLink.while_paused`); also returns the transfer's size
        (`bytes`, `num_chunks`)."""
        assert self.sender is not None, "init() must run before a push"
        sender = self.sender
        return self.link.while_paused(lambda: sender.push(named_tensors, version=label, metas=metas))

    def close(self) -> None:
        """Leave the group (`init()` forms a new one)."""
        sender, self.sender = self.sender, None
        if sender is not None and self.link.is_open():
            self.link.run(sender.close(), timeout_s=30)

    def __str__(self) -> str:
        return f"CollectiveTransport({self.backend})"


def nccl_failure_hint(message: str) -> str | None:
    """What to tell the user when NCCL could not form the group: two ranks on one GPU are refused."""
    if "invalid usage" not in message:
        return None
    return (
        "NCCL refuses two ranks on one GPU: the server most likely runs on the trainer's GPU. Use CUDA IPC "
        f"instead: for vLLM restart it as `{VLLM_IPC_RESTART}` (risk: {INSECURE_RISK}); the embedded server "
        "does it by itself when it reports its GPU (`asyncgrpo serve` of this version)"
    )
