"""Trainer side of the CUDA IPC weight transfer (see `asyncgrpo.sync.ipc` for the wire forms).

    init():  POST /init_weight_transfer_engine {"backend": "ipc", "packed": true}   (vLLM: {"packed": true})
    push():  POST /start_weight_update
             for each chunk of plan_chunks(sizes, B): pack it at byte 0 of the shared buffer,
                 synchronize, POST /update_weights (returns once the server copied it)
             POST /finish_weight_update {"weight_version"}     (the server releases the handle)

One CUDA buffer of the largest chunk's size is allocated on first use and kept across pushes (the
server reads it by handle, so it must stay alive and unchanged until each reply). Straight-line: the
HTTP reply is the transfer, there is no collective to run beside it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from asyncgrpo.generation.client import GenerationClient
from asyncgrpo.sync.ipc import embedded_update_info, share_buffer, vllm_update_info
from asyncgrpo.sync.packed import (
    DEFAULT_BUFFER_SIZE_BYTES,
    TensorMeta,
    check_tensor,
    plan_chunks,
    tensor_bytes,
)

logger = logging.getLogger(__name__)


class IpcSender:
    """`dialect`: "embedded" (JSON handles) or "vllm" (vLLM 0.33's ipc backend, pickled handles)."""

    def __init__(
        self,
        client: GenerationClient,
        *,
        device: torch.device,
        dialect: str,
        buffer_size_bytes: int = DEFAULT_BUFFER_SIZE_BYTES,
    ) -> None:
        if dialect not in ("embedded", "vllm"):
            raise ValueError(f"IPC dialect must be 'embedded' or 'vllm', got {dialect!r}")
        if torch.device(device).type != "cuda":
            raise ValueError(f"CUDA IPC needs a CUDA trainer, got device {device}")
        self._client = client
        self.device = torch.device(device)
        self.dialect = dialect
        self.buffer_size_bytes = buffer_size_bytes
        self._buffer: torch.Tensor | None = None

    async def init(self) -> None:
        info: dict[str, Any] = {"packed": True}
        if self.dialect == "embedded":
            info["backend"] = "ipc"
        await self._client.init_weight_transfer_engine(info)

    def _shared_buffer(self, nbytes: int) -> torch.Tensor:
        if self._buffer is None or self._buffer.numel() < nbytes:
            self._buffer = None  # free the old one first: on a shared GPU memory is tight
            self._buffer = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        return self._buffer

    async def push(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], *, version: str, metas: Sequence[TensorMeta]
    ) -> dict[str, float]:
        metas = list(metas)
        if not metas:
            raise ValueError("push() needs at least one tensor")
        chunks = plan_chunks([m.nbytes for m in metas], self.buffer_size_bytes)
        buffer = self._shared_buffer(max(c.nbytes for c in chunks))
        shared = share_buffer(buffer) if self.dialect == "embedded" else None
        t0 = time.monotonic()
        await self._client.start_weight_update()
        it = iter(named_tensors)
        for chunk in chunks:
            chunk_metas = metas[chunk.start : chunk.stop]
            for meta, offset in zip(chunk_metas, chunk.offsets):
                name, tensor = next(it, (None, None))
                if tensor is None:
                    raise ValueError(f"weight update: the tensor iterator ended before {meta.name!r}")
                check_tensor(meta, name, tensor)
                buffer[offset : offset + meta.nbytes].copy_(tensor_bytes(tensor.to(self.device)))
            torch.cuda.current_stream(self.device).synchronize()  # the server reads from another process
            if shared is not None:
                info = embedded_update_info(chunk_metas, shared)
            else:
                info = vllm_update_info(chunk_metas, buffer)
            await self._client.update_weights(info)
        if next(it, None) is not None:
            raise ValueError(
                f"weight update: the tensor iterator yields more than the {len(metas)} announced tensors")
        await self._client.finish_weight_update(version)
        torch.cuda.ipc_collect()  # release what the server let go of
        transfer_s = time.monotonic() - t0
        nbytes = sum(m.nbytes for m in metas)
        logger.info("pushed weights %s over CUDA IPC: %.1f MB in %d chunks, %.3fs", version, nbytes / 1e6,
                    len(chunks), transfer_s)
        return {"transfer_s": transfer_s, "bytes": float(nbytes), "num_tensors": float(len(metas)),
                "num_chunks": float(len(chunks))}

    async def close(self) -> None:
        self._buffer = None
