"""Trainer side of the weight transfer: `WeightSender`, rank 0 of the transfer group.

    init():  GET /get_world_size -> W
             POST /init_weight_transfer_engine {init_info}  ||  own group init (rank 0) + warm-up
    push():  POST /start_weight_update
             POST /update_weights {update_info}              ||  broadcast the chunks in order
             POST /finish_weight_update {"weight_version"}
    push_delta():  the same, with the update_info and chunks of a delta (`asyncgrpo.sync.delta`; the
             embedded server only): a 412 after the last chunk is `DeltaRejected`, the group in step

`||` = concurrently: the HTTP call returns only once the server side finished its part, so the
trainer's part runs beside it; if the HTTP call fails first, its error is raised at once (the group
is then out of step: `close()` and `init()` again). Pausing and resuming generation is the caller's
job. Backends: "nccl" (vLLM >= 0.30 or the embedded server on GPU; UID rendezvous) and "gloo" (the
embedded server on CPU; the sender hosts the TCPStore, see `asyncgrpo.sync.gloo`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch

from asyncgrpo.generation.client import GenerationClient
from asyncgrpo.generation.transport import ServerRequestError
from asyncgrpo.sync.communicator import Communicator, in_daemon_thread
from asyncgrpo.sync.delta import DeltaUpdate
from asyncgrpo.sync.packed import (
    DEFAULT_BUFFER_SIZE_BYTES,
    TensorMeta,
    TransferInit,
    check_tensor,
    iter_packed_chunks,
    update_info_from_metas,
)

logger = logging.getLogger(__name__)

_REJECT_WINDOW_S = 0.05
"""How long `push` lets the server reject the metadata before the first byte is broadcast."""


class WeightTransferError(RuntimeError):
    """A weight transfer failed; the group is out of step and must be re-initialised."""


class DeltaRejected(WeightTransferError):
    """The server refused a weight delta (HTTP 412: it holds another base, or would end with other weights
    than the trainer's) after receiving all of it: the group is in step, the update still open; push the
    full weights."""


def delta_rejection(exc: BaseException | None) -> ServerRequestError | None:
    """The server's 412 refusal of a weight delta behind `exc` (itself or its cause), if it is one."""
    while exc is not None:
        if isinstance(exc, ServerRequestError) and exc.status == 412:
            return exc
        exc = exc.__cause__
    return None


class WeightSender:
    """Pushes named tensors to every worker of one server. `device` is where the chunks are packed
    and broadcast from (a CUDA device for NCCL, CPU for gloo); `timeout_s` bounds each step
    (`vllm_server_timeout`); `master_address` is the address the server reaches this process at
    (gloo only)."""

    def __init__(
        self,
        client: GenerationClient,
        *,
        backend: str,
        device: torch.device,
        packed: bool = True,
        buffer_size_bytes: int = DEFAULT_BUFFER_SIZE_BYTES,
        timeout_s: float = 1800.0,
        master_address: str = "127.0.0.1",
    ) -> None:
        if backend not in ("nccl", "gloo"):
            raise ValueError(f"weight transfer backend must be 'nccl' or 'gloo', got {backend!r}")
        if buffer_size_bytes < 1:
            raise ValueError(f"buffer_size_bytes must be >= 1, got {buffer_size_bytes}")
        self._client = client
        self.backend = backend
        self.device = torch.device(device)
        self.packed = packed
        self.buffer_size_bytes = buffer_size_bytes
        self.timeout_s = timeout_s
        self.master_address = master_address
        self._comm: Communicator | None = None
        self._store: Any = None
        self._broken: str | None = None
        self._session_open = False

    # ---------------------------------------------------------------------------------- init

    async def init(self) -> None:
        """Form the group with the server's workers (they are ranks 1..W)."""
        if self._comm is not None:
            raise RuntimeError("WeightSender is already initialised; close() it first")
        world_size = await self._client.get_world_size() + 1
        if self.backend == "nccl":
            from asyncgrpo.sync.nccl import NcclCommunicator, get_unique_id, load_nccl

            info = self._client.info or await self._client.detect()
            if info.dialect < (0, 30, 0):
                raise RuntimeError(
                    f"server version {info.version} has no NCCL unique-id rendezvous (vLLM >= 0.30); "
                    "upgrade vLLM"
                )
            uid = get_unique_id(load_nccl())
            config = TransferInit(
                "nccl",
                world_size,
                packed=self.packed,
                buffer_size_bytes=self.buffer_size_bytes,
                nccl_unique_id=uid,
            )

            def make() -> Communicator:
                return NcclCommunicator(
                    uid, rank=0, world_size=world_size, device=self.device, timeout_s=self.timeout_s
                )

        else:
            from asyncgrpo.sync.gloo import GlooCommunicator, host_store

            store = host_store(self.master_address, self.timeout_s)
            self._store = store
            config = TransferInit(
                "gloo",
                world_size,
                packed=self.packed,
                buffer_size_bytes=self.buffer_size_bytes,
                master_address=self.master_address,
                master_port=store.port,
            )

            def make() -> Communicator:
                return GlooCommunicator(
                    master_address=self.master_address,
                    master_port=store.port,
                    rank=0,
                    world_size=world_size,
                    timeout_s=self.timeout_s,
                    store=store,
                )

        def join() -> Communicator:
            comm = make()
            try:
                warmup = torch.zeros(1, dtype=torch.float32, device=self.device)
                comm.all_reduce_sum_(warmup)
                comm.synchronize()
            except BaseException:
                comm.close()
                raise
            return comm

        t0 = time.monotonic()
        server = asyncio.ensure_future(self._client.init_weight_transfer_engine(config.to_init_info()))
        # a daemon thread: when the server refuses to join, the rendezvous left waiting must not hold the
        # process at exit until its timeout (asyncio.run joins the default executor's threads)
        local = in_daemon_thread(join, "asyncgrpo-weight-group")
        try:
            await self._both(server, local, "init_weight_transfer_engine")
        except BaseException:
            local.add_done_callback(_close_result)
            self._store = None
            raise
        self._comm, self._broken = local.result(), None
        logger.info(
            "weight transfer group up (%s, %d ranks, packed %s) in %.2fs",
            self.backend,
            world_size,
            self.packed,
            time.monotonic() - t0,
        )

    async def _both(self, server: asyncio.Future, local: asyncio.Future, what: str) -> None:
        """Wait for the server's HTTP call and our own part; the first failure raises at once."""
        done, pending = await asyncio.wait(
            {server, local}, timeout=self.timeout_s, return_when=asyncio.FIRST_EXCEPTION
        )
        failed = [f for f in done if f.exception() is not None]
        if failed or pending:
            server.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.gather(server, return_exceptions=True)
        if server in failed:
            raise WeightTransferError(
                f"{what}: the server failed: {server.exception()}"
            ) from server.exception()
        if local in failed:
            raise WeightTransferError(
                f"{what}: the trainer side failed: {local.exception()}"
            ) from local.exception()
        if pending:
            raise TimeoutError(
                f"{what} did not complete within {self.timeout_s:.0f}s; check the server log, and raise "
                "`vllm_server_timeout` if the transfer is just slow"
            )

    # ---------------------------------------------------------------------------------- push

    async def push(
        self,
        named_tensors: Iterable[tuple[str, torch.Tensor]],
        *,
        version: str,
        metas: Sequence[TensorMeta] | None = None,
    ) -> dict[str, float]:
        """Send one full update and label it `version`.

        Without `metas`, `named_tensors` is materialised first (all tensors alive at once). To
        produce tensors lazily (e.g. FSDP gathering layer by layer), pass `metas` (name, dtype and
        full shape of every tensor, in order) and an iterator yielding exactly those tensors; at most
        one chunk of tensors is then held at a time. Returns `{"transfer_s", "bytes", "num_tensors",
        "num_chunks"}`."""
        self._check_ready()
        if metas is None:
            named_tensors = list(named_tensors)
            metas = [TensorMeta.of(name, tensor) for name, tensor in named_tensors]
        metas = list(metas)
        if not metas:
            raise ValueError(
                "push() needs at least one tensor (empty lists mean 'reuse the last metadata' to vLLM)"
            )
        update_info = update_info_from_metas(metas)  # checks every dtype can be sent
        stats, reply = await self._transfer(update_info, metas, named_tensors, version=version)
        logger.info("pushed weights %s: %d tensors, %.1f MB in %d chunks, %.2fs (%s)", version, len(metas),
                    stats["bytes"] / 1e6, stats["num_chunks"], stats["transfer_s"], reply)
        return {**stats, "num_tensors": float(len(metas))}

    async def push_delta(self, update: DeltaUpdate, *, version: str) -> dict[str, float]:
        """Send one delta update (`asyncgrpo.sync.delta`: the changed words of every tensor against the
        server's weight version `update.base_version`; the embedded server only) and label it `version`.
        A server that holds another version, or whose weights then differ from the trainer's, rejects
        it after receiving all of it: `DeltaRejected`, and the group stays in step (push the full
        weights). Returns what `push` does, with `bytes` those of the delta."""
        self._check_ready()
        stats, reply = await self._transfer(update.update_info(), update.wire_metas(), iter(update.wire()),
                                            version=version)
        logger.info("pushed a weight delta %s -> %s: %.2f MB of %.1f MB (%.2f%% of the elements changed) in "
                    "%d chunks, %.2fs (%s)", update.base_version, version, stats["bytes"] / 1e6,
                    update.full_nbytes / 1e6, 100 * update.changed_frac, stats["num_chunks"],
                    stats["transfer_s"], reply)
        return {**stats, "num_tensors": float(len(update.metas))}

    def _check_ready(self) -> None:
        if self._comm is None:
            raise RuntimeError("WeightSender.init() must complete before push()")
        if self._broken is not None:
            raise WeightTransferError(
                f"the transfer group is out of step ({self._broken}); close() and init() again"
            )

    async def _transfer(
        self,
        update_info: dict[str, Any],
        wire_metas: Sequence[TensorMeta],
        wire: Iterable[tuple[str, torch.Tensor]],
        *,
        version: str,
    ) -> tuple[dict[str, float], str]:
        """start / update_weights(update_info) || broadcast `wire` (exactly `wire_metas`) / finish.
        Returns `{"transfer_s", "bytes", "num_chunks"}` and the server's reply."""
        t0 = time.monotonic()
        await self._start_session()
        self._session_open = True  # until finish succeeds: a failed push leaves the server mid-update
        update = asyncio.ensure_future(self._client.update_weights(update_info))
        num_chunks = 0
        try:
            await asyncio.wait({update}, timeout=_REJECT_WINDOW_S)
            if update.done() and update.exception() is not None:
                rejected = delta_rejection(update.exception())
                if rejected is not None:
                    raise DeltaRejected(str(rejected)) from rejected
                raise WeightTransferError(
                    f"the server rejected update_weights before any byte was sent: {update.exception()}; "
                    "the update is not finished: the next push resends every tensor"
                ) from update.exception()
        except BaseException:
            if not update.done():
                update.cancel()
            raise
        sent_all = False
        try:
            stream = torch.cuda.current_stream(self.device) if self.device.type == "cuda" else None
            for buffer in self._buffers(list(wire_metas), wire):
                if update.done():
                    update.result()  # the server failed: raise its error
                    raise WeightTransferError(
                        "the server finished update_weights before receiving every chunk"
                    )
                sent = asyncio.ensure_future(asyncio.to_thread(self._send, buffer, stream))
                await asyncio.wait(
                    {sent, update}, timeout=self.timeout_s, return_when=asyncio.FIRST_COMPLETED
                )
                failure = update.exception() if update.done() else None
                if failure is not None and delta_rejection(failure) is None:
                    update.result()  # the server failed mid-transfer: raise its error
                # its reply (a success, or a delta refused once received) may overtake our last broadcast's
                # return: the broadcast completes, the server read it all
                if update.done() and not sent.done():
                    await asyncio.wait({sent}, timeout=self.timeout_s)
                if not sent.done():
                    raise TimeoutError(
                        f"broadcasting weights stalled for {self.timeout_s:.0f}s; raise "
                        "`vllm_server_timeout` if the transfer is just slow"
                    )
                sent.result()
                num_chunks += 1
            sent_all = True
            reply = await asyncio.wait_for(update, timeout=self.timeout_s)
        except BaseException as exc:
            rejected = delta_rejection(exc)
            if rejected is not None and sent_all:  # the server received it all, then refused it
                raise DeltaRejected(str(rejected)) from rejected
            self._broken = f"an update failed: {exc}"
            if not update.done():
                update.cancel()
            raise
        await self._client.finish_weight_update(version)
        self._session_open = False
        stats = {
            "transfer_s": time.monotonic() - t0,
            "bytes": float(sum(m.nbytes for m in wire_metas)),
            "num_chunks": float(num_chunks),
        }
        return stats, reply.get("message", "ok")

    async def _start_session(self) -> None:
        """POST /start_weight_update. After a failed push some servers keep that update's session
        open (and refuse a new start); the complete resend then goes into the open session."""
        try:
            await self._client.start_weight_update()
        except ServerRequestError as exc:
            if not self._session_open or exc.status < 500:
                raise
            logger.warning("the server kept the failed update open (%s); resending into it", exc.message)

    def _buffers(
        self, metas: list[TensorMeta], named_tensors: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterator[torch.Tensor]:
        """What travels, in order: packed uint8 chunks, or (unpacked) each tensor as is."""
        if self.packed:
            yield from iter_packed_chunks(metas, named_tensors, self.buffer_size_bytes, self.device)
            return
        it = iter(named_tensors)
        for meta in metas:
            try:
                name, tensor = next(it)
            except StopIteration:
                raise ValueError(f"weight update: the tensor iterator ended before {meta.name!r}") from None
            check_tensor(meta, name, tensor)
            yield tensor.to(self.device).contiguous()
        if next(it, None) is not None:
            raise ValueError(
                f"weight update: the tensor iterator yields more than the {len(metas)} announced tensors"
            )

    def _send(self, buffer: torch.Tensor, stream: torch.cuda.Stream | None) -> None:
        """Broadcast one buffer and wait for it (worker thread). On CUDA it is enqueued on the
        producer's stream, so it runs after the packing that wrote the buffer."""
        comm = self._comm
        assert comm is not None
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            comm.broadcast_(buffer, 0)
            comm.synchronize()

    # ---------------------------------------------------------------------------------- close

    async def close(self) -> None:
        comm, self._comm = self._comm, None
        if comm is not None:
            await asyncio.to_thread(comm.close)
        self._store = None


def _close_result(future: asyncio.Future) -> None:
    """A group that formed after its init was abandoned must still be closed."""
    if not future.cancelled() and future.exception() is None:
        future.result().close()
