"""A minimal NCCL communicator through ctypes: the torch-only side of vLLM's weight-transfer group
(vllm-protocol.md 5.2). The trainer needs no vLLM: rank 0 draws a `ncclUniqueId`, sends it as
`nccl_unique_id_b64`, and every rank enters `ncclCommInitRank` concurrently.

The library is torch's bundled `libnccl.so.2`: `$ASYNCGRPO_NCCL_SO_PATH`, else `$VLLM_NCCL_SO_PATH`,
else the `nvidia-nccl-*` wheel, else the dynamic loader's `libnccl.so.2` (already loaded by torch's
CUDA build). `torch.cuda.nccl.init_rank` is deliberately not used (it fails on some builds with a
`PY_SSIZE_T_CLEAN` SystemError).

Collectives run on the current CUDA stream of the communicator's device. NCCL has no timeouts of its
own: init runs in a daemon thread joined with a timeout, and `synchronize` polls a CUDA event until
a deadline, then aborts the communicator (a timed-out group is dead; re-initialise it).
"""

from __future__ import annotations

import ctypes
import glob
import logging
import os
import threading
import time

import torch

logger = logging.getLogger(__name__)

NCCL_SUM = 0
NCCL_DTYPES: dict[torch.dtype, int] = {
    torch.int8: 0,
    torch.uint8: 1,
    torch.int32: 2,
    torch.int64: 4,
    torch.float16: 6,
    torch.float32: 7,
    torch.float64: 8,
    torch.bfloat16: 9,
    torch.float8_e4m3fn: 10,
}
_NCCL_IN_PROGRESS = 7


class NcclUniqueId(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_byte * 128)]


def find_nccl_library() -> str:
    """Path (or soname) of the NCCL library to load; see the module docstring for the order."""
    for var in ("ASYNCGRPO_NCCL_SO_PATH", "VLLM_NCCL_SO_PATH"):
        path = os.environ.get(var)
        if path:
            if not os.path.exists(path):
                raise FileNotFoundError(f"${var} points to {path!r}, which does not exist")
            return path
    try:
        import nvidia  # namespace package of the nvidia-* wheels

        for root in list(getattr(nvidia, "__path__", [])):
            found = sorted(glob.glob(os.path.join(root, "*", "lib", "libnccl.so*")))
            if found:
                return found[0]
    except ImportError:
        pass
    return "libnccl.so.2"


class _Lib:
    """Typed entry points of libnccl."""

    def __init__(self, path: str) -> None:
        try:
            lib = ctypes.CDLL(path)
        except OSError as exc:
            raise RuntimeError(
                f"cannot load NCCL from {path!r} ({exc}); install torch's CUDA build (nvidia-nccl wheel) "
                "or set ASYNCGRPO_NCCL_SO_PATH to libnccl.so.2"
            ) from exc
        self.path = path
        c_int, c_void_p, c_size_t = ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t
        sig = {
            "ncclGetErrorString": (ctypes.c_char_p, [c_int]),
            "ncclGetVersion": (c_int, [ctypes.POINTER(c_int)]),
            "ncclGetUniqueId": (c_int, [ctypes.POINTER(NcclUniqueId)]),
            "ncclCommInitRank": (c_int, [ctypes.POINTER(c_void_p), c_int, NcclUniqueId, c_int]),
            "ncclAllReduce": (c_int, [c_void_p, c_void_p, c_size_t, c_int, c_int, c_void_p, c_void_p]),
            "ncclBroadcast": (c_int, [c_void_p, c_void_p, c_size_t, c_int, c_int, c_void_p, c_void_p]),
            "ncclCommAbort": (c_int, [c_void_p]),
        }
        for name, (restype, argtypes) in sig.items():
            fn = getattr(lib, name)
            fn.restype, fn.argtypes = restype, argtypes
            setattr(self, name, fn)

    def check(self, result: int, what: str) -> None:
        if result != 0:
            message = self.ncclGetErrorString(result).decode(errors="replace")
            raise RuntimeError(f"NCCL {what} failed: {message} (ncclResult_t {result})")

    def version(self) -> str:
        v = ctypes.c_int()
        self.check(self.ncclGetVersion(ctypes.byref(v)), "ncclGetVersion")
        code = v.value
        major, rest = divmod(code, 10000)
        return f"{major}.{rest // 100}.{rest % 100}"


def load_nccl(path: str | None = None) -> _Lib:
    """Load and type the NCCL library (the dynamic loader keeps one copy per process)."""
    lib = _Lib(path or find_nccl_library())
    logger.debug("NCCL %s loaded from %s", lib.version(), lib.path)
    return lib


def get_unique_id(lib: _Lib | None = None) -> bytes:
    """A fresh 128-byte `ncclUniqueId` (rank 0 draws it and shares it with the other ranks)."""
    lib = lib or load_nccl()
    uid = NcclUniqueId()
    lib.check(lib.ncclGetUniqueId(ctypes.byref(uid)), "ncclGetUniqueId")
    return bytes(bytearray(uid.internal))


class NcclCommunicator:
    """rank/world_size of an NCCL group on `device`. Construct it on every rank at the same time; the
    constructor returns once all ranks joined, or raises `TimeoutError` after `timeout_s`."""

    def __init__(
        self,
        unique_id: bytes,
        *,
        rank: int,
        world_size: int,
        device: torch.device,
        timeout_s: float,
        library_path: str | None = None,
    ) -> None:
        if device.type != "cuda":
            raise ValueError(
                f"the NCCL weight transfer needs a CUDA device, got {device}; use backend 'gloo' on CPU"
            )
        if len(unique_id) != 128:
            raise ValueError(f"ncclUniqueId must be 128 bytes, got {len(unique_id)}")
        self._lib = load_nccl(library_path)
        self.rank, self.world_size, self.timeout_s = rank, world_size, timeout_s
        self.device = torch.device(
            "cuda", device.index if device.index is not None else torch.cuda.current_device()
        )
        self._comm: ctypes.c_void_p | None = None

        uid = NcclUniqueId()
        ctypes.memmove(uid.internal, unique_id, 128)
        comm = ctypes.c_void_p()
        outcome: dict[str, object] = {}

        def init() -> None:
            try:
                with torch.cuda.device(self.device):
                    outcome["result"] = self._lib.ncclCommInitRank(ctypes.byref(comm), world_size, uid, rank)
            except BaseException as exc:  # noqa: BLE001 -- re-raised by the waiting thread below
                outcome["error"] = exc

        thread = threading.Thread(target=init, name=f"nccl-init-rank{rank}", daemon=True)
        thread.start()
        thread.join(timeout_s)
        if thread.is_alive():
            raise TimeoutError(
                f"ncclCommInitRank (rank {rank} of {world_size}) did not complete within {timeout_s:.0f}s: "
                "not every rank joined. Check that the server accepted init_weight_transfer_engine, that it "
                "was started with --weight-transfer-config, that NCCL versions match and NCCL_* variables "
                "agree, and that the hosts can reach each other (NCCL_SOCKET_IFNAME)"
            )
        if "error" in outcome:
            raise outcome["error"]  # type: ignore[misc]
        self._lib.check(int(outcome["result"]), f"ncclCommInitRank (rank {rank} of {world_size})")  # type: ignore[arg-type]
        self._comm = comm
        logger.debug("NCCL group up: rank %d of %d on %s", rank, world_size, self.device)

    def _stream(self) -> int:
        return torch.cuda.current_stream(self.device).cuda_stream

    def _check_tensor(self, tensor: torch.Tensor) -> int:
        if self._comm is None:
            raise RuntimeError("the NCCL communicator is closed; initialise the weight transfer again")
        if tensor.device != self.device:
            raise ValueError(f"tensor on {tensor.device}, communicator on {self.device}")
        if not tensor.is_contiguous():
            raise ValueError("NCCL collectives need contiguous tensors")
        if tensor.dtype not in NCCL_DTYPES:
            raise ValueError(f"NCCL cannot carry {tensor.dtype}; allowed: {sorted(map(str, NCCL_DTYPES))}")
        return NCCL_DTYPES[tensor.dtype]

    def all_reduce_sum_(self, tensor: torch.Tensor) -> None:
        """In-place sum over all ranks, enqueued on the current stream."""
        dtype = self._check_tensor(tensor)
        ptr = ctypes.c_void_p(tensor.data_ptr())
        self._lib.check(
            self._lib.ncclAllReduce(
                ptr, ptr, tensor.numel(), dtype, NCCL_SUM, self._comm, ctypes.c_void_p(self._stream())
            ),
            "ncclAllReduce",
        )

    def broadcast_(self, tensor: torch.Tensor, src: int = 0) -> None:
        """In-place broadcast from `src`, enqueued on the current stream."""
        dtype = self._check_tensor(tensor)
        ptr = ctypes.c_void_p(tensor.data_ptr())
        self._lib.check(
            self._lib.ncclBroadcast(
                ptr, ptr, tensor.numel(), dtype, src, self._comm, ctypes.c_void_p(self._stream())
            ),
            "ncclBroadcast",
        )

    def synchronize(self) -> None:
        """Wait for the enqueued collectives, at most `timeout_s`; on timeout abort the group."""
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        deadline = time.monotonic() + self.timeout_s
        while not event.query():
            if time.monotonic() > deadline:
                self.close()
                raise TimeoutError(
                    f"NCCL collective did not finish within {self.timeout_s:.0f}s; the peers disagree on the "
                    "transfer (chunk count, sizes or order) or one of them died. The group was aborted: "
                    "initialise the weight transfer again"
                )
            time.sleep(0.0005)

    def close(self) -> None:
        """Free this rank's side of the group with `ncclCommAbort`, not `ncclCommDestroy`: destroy
        finalises collectively and blocks until every peer destroys too, which a server that keeps
        its group (or a trainer that died) never does. Call it when no collective is pending."""
        comm, self._comm = self._comm, None
        if comm is not None:
            self._lib.check(self._lib.ncclCommAbort(comm), "ncclCommAbort")
