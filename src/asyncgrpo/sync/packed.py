"""The wire format of a weight transfer (vllm-protocol.md 5.1-5.5): the `init_info` of a group
(`TransferInit`), the `update_info` of an update (`TensorMeta`), and the byte-exact packed layout.
Pure: no I/O.

An update is described by `update_info = {"names", "dtype_names", "shapes"}` (here: a list of
`TensorMeta`). In packed mode the tensors, in `names` order, are concatenated as raw little-endian
bytes into chunks; each chunk is one uint8 broadcast from rank 0. Chunking (`plan_chunks`) keeps a
running total `t` that starts at 0 in every chunk: append the tensor, `t += nbytes`, and close the
chunk when `t > buffer_size_bytes` (strictly: a chunk that reaches exactly B stays open, and the
crossing tensor stays in the chunk it crossed). After the last tensor any chunk holding at least
one tensor is closed, even one of 0 bytes. No headers, padding or alignment.

Unpacked mode sends one broadcast per tensor, of its own dtype and `numel` elements.

Sender and receiver both derive the chunk plan from the metadata alone, so they agree byte for byte.
"""

from __future__ import annotations

import base64
import binascii
import math
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

WIRE_DTYPES: dict[str, torch.dtype] = {
    "int8": torch.int8,
    "uint8": torch.uint8,
    "int32": torch.int32,
    "int64": torch.int64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "float64": torch.float64,
    "float8_e4m3fn": torch.float8_e4m3fn,
}
"""dtypes the protocol can carry (the NCCL-typed set of unpacked mode); names are torch attributes."""

DEFAULT_BUFFER_SIZE_BYTES = 1 << 30
"""`packed_buffer_size_bytes` unless set: vLLM's default chunk size (1 GiB)."""


def dtype_name(dtype: torch.dtype) -> str:
    """`torch.bfloat16` -> `"bfloat16"` (the wire's `dtype_names`)."""
    name = str(dtype).removeprefix("torch.")
    if WIRE_DTYPES.get(name) != dtype:
        raise ValueError(f"dtype {dtype} cannot be sent; use one of {sorted(WIRE_DTYPES)}")
    return name


@dataclass(frozen=True)
class TensorMeta:
    """Name, dtype and full (unsharded) shape of one tensor of an update."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)  # 1 for a 0-d tensor

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    @classmethod
    def of(cls, name: str, tensor: torch.Tensor) -> TensorMeta:
        return cls(name, tensor.dtype, tuple(tensor.shape))


def update_info_from_metas(metas: Sequence[TensorMeta]) -> dict[str, list[Any]]:
    """The `update_info` body of POST /update_weights."""
    return {
        "names": [m.name for m in metas],
        "dtype_names": [dtype_name(m.dtype) for m in metas],
        "shapes": [list(m.shape) for m in metas],
    }


def metas_from_update_info(info: Any) -> list[TensorMeta]:
    """Validate an `update_info` body; errors are `ValueError("Invalid update_info: ...")`.
    Three empty lists give an empty list (the caller decides whether to reuse earlier metadata)."""

    def bad(msg: str) -> ValueError:
        return ValueError(f"Invalid update_info: {msg}")

    if isinstance(info, list):
        raise bad("the per-worker list form is not supported; send one object {names, dtype_names, shapes}")
    if not isinstance(info, dict):
        raise bad(f"expected an object, got {type(info).__name__}")
    keys = {"names", "dtype_names", "shapes"}
    if set(info) != keys:
        raise bad(f"keys must be exactly {sorted(keys)}, got {sorted(info)}")
    names, dtypes, shapes = info["names"], info["dtype_names"], info["shapes"]
    if not all(isinstance(v, list) for v in (names, dtypes, shapes)):
        raise bad("'names', 'dtype_names' and 'shapes' must be lists")
    if not len(names) == len(dtypes) == len(shapes):
        raise bad(f"lengths differ: {len(names)} names, {len(dtypes)} dtype_names, {len(shapes)} shapes")
    metas = []
    for i, (name, dt, shape) in enumerate(zip(names, dtypes, shapes)):
        if not isinstance(name, str) or not name:
            raise bad(f"names[{i}] must be a non-empty string, got {name!r}")
        if dt not in WIRE_DTYPES:
            raise bad(f"dtype_names[{i}] = {dt!r} for {name!r}; allowed: {sorted(WIRE_DTYPES)}")
        if not isinstance(shape, list) or not all(
            isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape
        ):
            raise bad(f"shapes[{i}] for {name!r} must be a list of non-negative integers, got {shape!r}")
        metas.append(TensorMeta(name, WIRE_DTYPES[dt], tuple(shape)))
    if len({m.name for m in metas}) != len(metas):
        raise bad("names must be unique")
    return metas


@dataclass(frozen=True)
class Chunk:
    """Tensors `[start, stop)` of the update, laid out at `offsets` (bytes) in a buffer of `nbytes`."""

    start: int
    stop: int
    offsets: tuple[int, ...]
    nbytes: int


def plan_chunks(sizes: Sequence[int], buffer_size_bytes: int) -> list[Chunk]:
    """Split tensors of `sizes` bytes into chunks with the strict `t > B` rule (see module doc)."""
    if buffer_size_bytes < 1:
        raise ValueError(f"buffer_size_bytes must be >= 1, got {buffer_size_bytes}")
    chunks: list[Chunk] = []
    start, offsets, t = 0, [], 0
    for i, size in enumerate(sizes):
        offsets.append(t)
        t += size
        if t > buffer_size_bytes:
            chunks.append(Chunk(start, i + 1, tuple(offsets), t))
            start, offsets, t = i + 1, [], 0
    if offsets:
        chunks.append(Chunk(start, len(sizes), tuple(offsets), t))
    return chunks


def tensor_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's row-major bytes as a flat uint8 view (a copy only if it is not contiguous)."""
    return tensor.contiguous().reshape(-1).view(torch.uint8)


def pack(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """Concatenate the tensors' bytes into one uint8 buffer on their device."""
    assert tensors, "a chunk holds at least one tensor"
    return torch.cat([tensor_bytes(t) for t in tensors])


def unpack(buffer: torch.Tensor, metas: Sequence[TensorMeta], offsets: Sequence[int]) -> list[torch.Tensor]:
    """Inverse of `pack`: tensors viewing `buffer` in place where the byte offset is a multiple of
    the itemsize, copies otherwise."""
    assert buffer.dtype == torch.uint8 and buffer.dim() == 1
    out = []
    for meta, offset in zip(metas, offsets):
        raw = buffer[offset : offset + meta.nbytes]
        if meta.dtype.itemsize > 1 and offset % meta.dtype.itemsize:
            raw = raw.clone()
        out.append(raw.view(meta.dtype).view(meta.shape))
    return out


def check_tensor(meta: TensorMeta, name: str, tensor: torch.Tensor) -> None:
    """The tensor handed to the sender must be what the metadata announced."""
    if name != meta.name or tensor.dtype != meta.dtype or tuple(tensor.shape) != meta.shape:
        raise ValueError(
            f"weight update tensor mismatch: announced {meta.name!r} {dtype_name(meta.dtype)} "
            f"{list(meta.shape)}, got {name!r} {tensor.dtype} {list(tensor.shape)}; the tensor iterator must "
            "yield exactly the announced metadata, in order"
        )


def iter_packed_chunks(
    metas: Sequence[TensorMeta],
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    buffer_size_bytes: int,
    device: torch.device,
) -> Iterator[torch.Tensor]:
    """Pull tensors lazily (at most one chunk held at a time), check them against `metas`, and yield
    each packed chunk as a uint8 tensor on `device`."""
    it = iter(named_tensors)
    for chunk in plan_chunks([m.nbytes for m in metas], buffer_size_bytes):
        parts = []
        for meta in metas[chunk.start : chunk.stop]:
            try:
                name, tensor = next(it)
            except StopIteration:
                raise ValueError(
                    f"weight update: the tensor iterator ended before {meta.name!r} ({len(metas)} announced)"
                ) from None
            check_tensor(meta, name, tensor)
            parts.append(tensor.to(device))
        buffer = pack(parts)
        del parts  # the chunk's tensors go while it is broadcast (with sharded weights: gathered copies)
        yield buffer
    leftover = next(it, None)
    if leftover is not None:
        raise ValueError(
            f"weight update: the tensor iterator yields more than the {len(metas)} announced tensors"
        )


# init_info of POST /init_weight_transfer_engine (protocol 5.1)

NCCL_UNIQUE_ID_BYTES = 128
_INIT_KEYS_COMMON = {"rank_offset", "world_size", "packed", "packed_buffer_size_bytes", "packed_num_buffers"}
_INIT_KEYS_NCCL = _INIT_KEYS_COMMON | {"nccl_unique_id_b64", "master_address", "master_port"}
_INIT_KEYS_GLOO = _INIT_KEYS_COMMON | {"backend", "master_address", "master_port"}


@dataclass(frozen=True)
class TransferInit:
    """The `init_info` of a weight-transfer group (protocol 5.1). The trainer is rank 0; server
    workers are `rank_offset + i`.

    backend "nccl": UID rendezvous (`nccl_unique_id`, vLLM >= 0.30).
    backend "gloo": the embedded server on CPU; a TCPStore hosted by the trainer at
    `master_address:master_port`, init_info `{"backend": "gloo", "master_address", "master_port",
    "rank_offset", "world_size", "packed", "packed_buffer_size_bytes"}`."""

    backend: str
    world_size: int
    rank_offset: int = 1
    packed: bool = True
    buffer_size_bytes: int = DEFAULT_BUFFER_SIZE_BYTES
    num_buffers: int = 2
    nccl_unique_id: bytes | None = None
    master_address: str | None = None
    master_port: int | None = None

    def to_init_info(self) -> dict[str, Any]:
        info: dict[str, Any] = {}
        if self.backend == "nccl":
            assert self.nccl_unique_id is not None and len(self.nccl_unique_id) == NCCL_UNIQUE_ID_BYTES
            info["nccl_unique_id_b64"] = base64.b64encode(self.nccl_unique_id).decode("ascii")
        else:
            assert self.backend == "gloo" and self.master_address and self.master_port
            info.update(backend="gloo", master_address=self.master_address, master_port=self.master_port)
        info.update(rank_offset=self.rank_offset, world_size=self.world_size, packed=self.packed)
        if self.packed:
            info["packed_buffer_size_bytes"] = self.buffer_size_bytes
            if self.backend == "nccl":
                info["packed_num_buffers"] = self.num_buffers
        return info

    @classmethod
    def from_init_info(cls, info: Any) -> TransferInit:
        """Validate an `init_info` body; errors are `ValueError("Invalid init_info: ...")`."""

        def bad(msg: str) -> ValueError:
            return ValueError(f"Invalid init_info: {msg}")

        if not isinstance(info, dict):
            raise bad(f"expected an object, got {type(info).__name__}")
        if info.get("backend") == "gloo":
            backend, allowed = "gloo", _INIT_KEYS_GLOO
        elif "backend" in info:
            raise bad(f"'backend' must be 'gloo' when present, got {info['backend']!r}")
        else:
            backend, allowed = "nccl", _INIT_KEYS_NCCL
        unknown = sorted(set(info) - allowed)
        if unknown:
            raise bad(f"unknown key(s) {unknown} for backend {backend!r}; allowed: {sorted(allowed)}")

        def integer(key: str, minimum: int, default: int | None = None) -> int:
            value = info.get(key, default)
            if value is None:
                raise bad(f"missing '{key}'")
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                raise bad(f"'{key}' must be an integer >= {minimum}, got {value!r}")
            return value

        world_size = integer("world_size", 2)
        rank_offset = integer("rank_offset", 1)
        if rank_offset >= world_size:
            raise bad(f"'rank_offset' ({rank_offset}) must be smaller than 'world_size' ({world_size})")
        packed = info.get("packed", False)
        if not isinstance(packed, bool):
            raise bad(f"'packed' must be a boolean, got {packed!r}")
        buffer_size = integer("packed_buffer_size_bytes", 1, 1 << 30)
        num_buffers = integer("packed_num_buffers", 1, 2)
        uid = None
        address = info.get("master_address")
        port = info.get("master_port")
        if backend == "nccl":
            if "nccl_unique_id_b64" not in info:
                raise bad(
                    "'nccl_unique_id_b64' is required: this receiver has no TCP (master_address) rendezvous "
                    "for NCCL, which needs vLLM on the trainer"
                )
            if address is not None or port is not None:
                raise bad(
                    "give exactly one rendezvous: 'nccl_unique_id_b64' or 'master_address'/'master_port'"
                )
            try:
                uid = base64.b64decode(str(info["nccl_unique_id_b64"]), validate=True)
            except (binascii.Error, ValueError) as exc:
                raise bad(f"'nccl_unique_id_b64' is not standard base64: {exc}") from None
            if len(uid) != NCCL_UNIQUE_ID_BYTES:
                raise bad(
                    f"'nccl_unique_id_b64' decodes to {len(uid)} bytes, expected {NCCL_UNIQUE_ID_BYTES}"
                )
        else:
            if not isinstance(address, str) or not address:
                raise bad("'master_address' (the trainer's TCPStore host) is required for backend 'gloo'")
            port = integer("master_port", 1)
            if port > 65535:
                raise bad(f"'master_port' must be <= 65535, got {port}")
        return cls(
            backend=backend,
            world_size=world_size,
            rank_offset=rank_offset,
            packed=packed,
            buffer_size_bytes=buffer_size,
            num_buffers=num_buffers,
            nccl_unique_id=uid,
            master_address=address,
            master_port=port,
        )
