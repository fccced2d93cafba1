"""CUDA IPC weight transfer: the trainer and the server on the SAME GPU (NCCL refuses two ranks on
one device). The trainer packs the weights into one CUDA buffer (the chunk plan of `packed.py`),
exports it once per update, and sends its handle with each chunk's metadata; the server opens the
handle, copies each tensor into its parameters, and releases the handle when the update finishes.

Two wire forms of the same packed chunks:

    embedded server   update_info = {names, dtype_names, shapes, "ipc_buffer": IpcBuffer.to_json()}
                      plain JSON (bytes as standard base64): the server never unpickles network data
    vLLM 0.33 "ipc"   update_info = {names, dtype_names, shapes, tensor_sizes,
                      "ipc_handles_pickled": base64(pickle({gpu_uuid: reduce_tensor args}))}
                      vLLM unpickles it only with VLLM_ALLOW_INSECURE_SERIALIZATION=1, which lets
                      anyone who can reach its HTTP port run code in the server

init_info is `{"backend": "ipc", "packed": true}` (embedded) or `{"packed": true}` (vLLM).
"""

from __future__ import annotations

import base64
import binascii
import logging
import pickle
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from asyncgrpo.sync.packed import TensorMeta, metas_from_update_info, unpack, update_info_from_metas

logger = logging.getLogger(__name__)


def gpu_uuid(device: torch.device | str) -> str:
    """The physical GPU's UUID (the same in every process, whatever CUDA_VISIBLE_DEVICES says)."""
    device = torch.device(device)
    index = device.index if device.index is not None else torch.cuda.current_device()
    return str(torch.cuda.get_device_properties(index).uuid)


def _b64(data: bytes | None) -> str | None:
    return None if data is None else base64.b64encode(data).decode("ascii")


@dataclass(frozen=True)
class IpcBuffer:
    """A CUDA allocation shared by `torch.UntypedStorage._share_cuda_()`, in JSON-safe fields."""

    device_uuid: str
    storage_handle: bytes
    storage_size_bytes: int
    storage_offset_bytes: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes | None
    event_sync_required: bool

    def to_json(self) -> dict[str, Any]:
        return {
            "device_uuid": self.device_uuid,
            "storage_handle": _b64(self.storage_handle),
            "storage_size_bytes": self.storage_size_bytes,
            "storage_offset_bytes": self.storage_offset_bytes,
            "ref_counter_handle": _b64(self.ref_counter_handle),
            "ref_counter_offset": self.ref_counter_offset,
            "event_handle": _b64(self.event_handle),
            "event_sync_required": self.event_sync_required,
        }

    @classmethod
    def from_json(cls, fields: Any) -> IpcBuffer:
        """Validate the `ipc_buffer` of an update; errors are `ValueError("Invalid ipc_buffer: ...")`."""

        def bad(msg: str) -> ValueError:
            return ValueError(f"Invalid ipc_buffer: {msg}")

        if not isinstance(fields, dict):
            raise bad(f"expected an object, got {type(fields).__name__}")
        keys = {f for f in cls.__dataclass_fields__}
        if set(fields) != keys:
            raise bad(f"keys must be exactly {sorted(keys)}, got {sorted(fields)}")

        def raw(key: str, optional: bool = False) -> bytes | None:
            value = fields[key]
            if value is None and optional:
                return None
            try:
                return base64.b64decode(str(value), validate=True)
            except (binascii.Error, ValueError) as exc:
                raise bad(f"'{key}' is not standard base64: {exc}") from None

        def integer(key: str) -> int:
            value = fields[key]
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise bad(f"'{key}' must be an integer >= 0, got {value!r}")
            return value

        if not isinstance(fields["device_uuid"], str) or not fields["device_uuid"]:
            raise bad("'device_uuid' must be a non-empty string")
        if not isinstance(fields["event_sync_required"], bool):
            raise bad("'event_sync_required' must be a boolean")
        return cls(
            device_uuid=fields["device_uuid"],
            storage_handle=raw("storage_handle"),
            storage_size_bytes=integer("storage_size_bytes"),
            storage_offset_bytes=integer("storage_offset_bytes"),
            ref_counter_handle=raw("ref_counter_handle"),
            ref_counter_offset=integer("ref_counter_offset"),
            event_handle=raw("event_handle", optional=True),
            event_sync_required=fields["event_sync_required"],
        )


# buffers this process exported, by handle: CUDA cannot open a handle in the process that made it, and
# a server inside the trainer's process (`server.serve.ServerThread`) reads the trainer's buffer itself
_EXPORTED: dict[bytes, weakref.ref] = {}


def share_buffer(buffer: torch.Tensor) -> IpcBuffer:
    """Export a whole CUDA uint8 buffer (its storage must start at the allocation the caller keeps
    alive until the server released it)."""
    assert buffer.is_cuda and buffer.dtype == torch.uint8 and buffer.storage_offset() == 0
    (_, handle, size, offset, ref_handle, ref_offset, event_handle, event_sync) = (
        buffer.untyped_storage()._share_cuda_()
    )
    for key in [k for k, ref in _EXPORTED.items() if ref() is None]:
        del _EXPORTED[key]
    _EXPORTED[handle] = weakref.ref(buffer)
    return IpcBuffer(gpu_uuid(buffer.device), handle, size, offset, ref_handle, ref_offset, event_handle,
                     event_sync)


def open_buffer(shared: IpcBuffer, device: torch.device) -> torch.Tensor:
    """Map the trainer's buffer into this process as a flat uint8 tensor on `device` (same GPU); a
    buffer this process exported itself is that buffer."""
    exported = _EXPORTED.get(shared.storage_handle)
    if exported is not None and exported() is not None:
        return exported()
    torch.cuda._lazy_init()
    index = torch.device(device).index
    index = index if index is not None else torch.cuda.current_device()
    storage = torch.UntypedStorage._new_shared_cuda(
        index,
        shared.storage_handle,
        shared.storage_size_bytes,
        shared.storage_offset_bytes,
        shared.ref_counter_handle,
        shared.ref_counter_offset,
        shared.event_handle,
        shared.event_sync_required,
    )
    return torch.empty(0, dtype=torch.uint8, device=torch.device("cuda", index)).set_(
        storage, 0, (shared.storage_size_bytes,), (1,)
    )


def embedded_update_info(metas: Sequence[TensorMeta], shared: IpcBuffer) -> dict[str, Any]:
    """One chunk's `update_info` for the embedded server: its tensors lie from byte 0 of the buffer."""
    return {**update_info_from_metas(metas), "ipc_buffer": shared.to_json()}


def vllm_update_info(metas: Sequence[TensorMeta], buffer: torch.Tensor) -> dict[str, Any]:
    """One chunk's `update_info` for vLLM 0.33's ipc backend (packed): the handle as vLLM's
    `reduce_tensor` args keyed by GPU UUID, pickled and base64-encoded (its HTTP form)."""
    from torch.multiprocessing.reductions import reduce_tensor

    _, args = reduce_tensor(buffer)
    pickled = pickle.dumps({gpu_uuid(buffer.device): args})
    return {
        **update_info_from_metas(metas),
        "tensor_sizes": [m.nbytes for m in metas],
        "ipc_handles_pickled": base64.b64encode(pickled).decode("ascii"),
    }


def parse_embedded_update(update_info: Any) -> tuple[list[TensorMeta], IpcBuffer]:
    """Server side: validate an embedded IPC `update_info` (no CUDA needed)."""
    if not isinstance(update_info, dict) or "ipc_buffer" not in update_info:
        raise ValueError(
            "Invalid update_info: the ipc backend needs 'ipc_buffer' beside names, dtype_names and shapes"
        )
    rest = {k: v for k, v in update_info.items() if k != "ipc_buffer"}
    metas = metas_from_update_info(rest)
    if not metas:
        raise ValueError(
            "Invalid update_info: the ipc backend needs every chunk's names (no reuse of earlier ones)")
    return metas, IpcBuffer.from_json(update_info["ipc_buffer"])


class IpcReceiver:
    """The embedded server's end of an IPC transfer (what `WeightReceiver` is for NCCL/gloo).
    The trainer's buffer is opened once per update (every chunk reuses it) and released by
    `end_update()`, so torch's cross-process reference count is paired once per export."""

    config = None  # no collective group (WeightTransfer.store_address asks)

    def __init__(self, device: torch.device) -> None:
        self.device = torch.device(device)
        self.uuid = gpu_uuid(self.device)
        self._opened: tuple[bytes, torch.Tensor] | None = None

    def init(self, init_info: Any) -> None:
        if (not isinstance(init_info, dict) or set(init_info) - {"backend", "packed"}
                or init_info.get("packed", True) is not True):
            raise ValueError(
                "Invalid init_info: the ipc backend takes {'backend': 'ipc', 'packed': true}, "
                f"got {init_info!r}"
            )

    def receive(self, update_info: Any) -> Iterator[tuple[str, torch.Tensor]]:
        metas, shared = parse_embedded_update(update_info)
        if shared.device_uuid != self.uuid:
            raise ValueError(
                f"the trainer's buffer is on GPU {shared.device_uuid}, this server runs on GPU {self.uuid}: "
                "CUDA IPC works on one GPU only; the trainer must use NCCL for another GPU"
            )
        nbytes = sum(m.nbytes for m in metas)
        if nbytes > shared.storage_size_bytes:
            raise ValueError(
                f"Invalid update_info: the chunk needs {nbytes} bytes, the shared buffer holds "
                f"{shared.storage_size_bytes}"
            )
        if self._opened is None or self._opened[0] != shared.storage_handle:
            self._opened = (shared.storage_handle, open_buffer(shared, self.device))
        buffer = self._opened[1]
        offsets, t = [], 0
        for m in metas:
            offsets.append(t)
            t += m.nbytes
        return self._yield_then_sync(
            list(zip([m.name for m in metas], unpack(buffer[:nbytes], metas, offsets))))

    def _yield_then_sync(self, items: list[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        yield from items
        # the reply to update_weights lets the trainer overwrite the buffer: the copies must be done (those
        # of this thread's stream, not a trainer's kernels queued beside a server inside its process)
        torch.cuda.current_stream(self.device).synchronize()

    def end_update(self) -> None:
        self._opened = None

    def shutdown(self) -> None:
        self._opened = None
