"""The trainer's weight push, in one place: the model's serving weights -> a transport -> the server.

    push_weights(model, transport, dtype, version)
      |- one process, or DDP (rank 0 holds the full model): rank 0 streams weights_for_server(model)
      |- FSDP2 (is_sharded): every rank gathers bucket by bucket, rank 0 streams (see below)
      '- transport.push(named tensors, version, metas) -> timings for perf/weight_sync_*

A `WeightTransport` is what a backend must do: `init()` once before the first push, `push(...)` a
stream of (checkpoint name, full tensor in the serving dtype) labelled with a version, `close()`.
Today's implementation is `CollectiveTransport`: the server's weight-transfer group over NCCL (a CUDA
trainer) or gloo (CPU), driven through `ServerLink` (pause, broadcast the packed chunks, resume). A
transport that moves something other than the full weights (CUDA IPC handles, LoRA adapters) takes
the same stream and `metas`, and may ignore the tensors it does not need.

Sharded (FSDP2) models:

    every rank    for each bucket of `plan_chunks(sizes, bucket_bytes)`     (same buckets, same order)
                      full_tensor() of each of its parameters               (one all-gather each)
    rank 0            hands the bucket to the transport, which packs it into one chunk and sends it
    other ranks       drop it at once
    every rank    rank 0 broadcasts whether the push went through; a failure raises on every rank

The buckets are the sender's chunks (the same plan over the same sizes), so rank 0 holds at most one
bucket of gathered tensors plus its packed copy, never the whole model; the other ranks hold one
tensor. If the push fails part-way, rank 0 still gathers the remaining buckets (the other ranks are
inside those very collectives) before it reports the failure, so no rank waits on a collective that
never comes.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator, Sequence
from typing import Protocol

import torch

from asyncgrpo.generation.server_info import ServerDevice
from asyncgrpo.sync.packed import DEFAULT_BUFFER_SIZE_BYTES, TensorMeta, plan_chunks
from asyncgrpo.train.distributed import broadcast_from_rank0, rank_and_world_size
from asyncgrpo.train.model_setup import is_sharded, server_weight_metas, weights_for_server
from asyncgrpo.train.server_link import ServerLink
from asyncgrpo.train.transport_choice import (
    all_gpus_visible,
    choose_transport,
    nccl_failure_hint,
    same_gpu,
    sharing_hint,
)

logger = logging.getLogger(__name__)

NamedTensors = Iterator[tuple[str, torch.Tensor]]


class WeightTransport(Protocol):
    """Moves named tensors from the trainer (rank 0) to the inference server."""

    def init(self) -> None:
        """Set up the channel to the server (once, before the first push)."""

    def push(self, named_tensors: NamedTensors, *, version: str, metas: Sequence[TensorMeta]) -> dict[str, float]:
        """Send one full update labelled `version`; `named_tensors` yields exactly `metas`, in order, and is
        pulled lazily. Returns the time split (`total_s`, `pause_s`, `transfer_s`, ...) for perf/weight_sync_*."""

    def close(self) -> None:
        """Release the channel (idempotent)."""


class CollectiveTransport:
    """The server's weight-transfer group: NCCL from a CUDA trainer, gloo from a CPU one (`ServerLink`
    pauses the server, `asyncgrpo.sync.sender.WeightSender` broadcasts packed chunks, the server resumes)."""

    def __init__(self, link: ServerLink, device: torch.device, backend: str | None = None) -> None:
        self.link = link
        self.device = torch.device(device)
        self.backend = backend or ("nccl" if self.device.type == "cuda" else "gloo")

    def init(self) -> None:
        try:
            self.link.init_weight_transfer(self.device, self.backend)
        except RuntimeError as exc:
            hint = nccl_failure_hint(str(exc)) if self.backend == "nccl" else None
            if hint is None:
                raise
            raise RuntimeError(f"{exc}\n{hint}") from exc

    def push(self, named_tensors: NamedTensors, *, version: str, metas: Sequence[TensorMeta]) -> dict[str, float]:
        return self.link.sync_weights(lambda: named_tensors, version=version, metas=metas)

    def close(self) -> None:
        self.link.close_weight_transfer()


class IpcTransport:
    """CUDA IPC on the server's own GPU (`asyncgrpo.sync.ipc_sender.IpcSender`), paused like the
    collective path; `dialect` "embedded" (JSON handles) or "vllm" (vLLM 0.33's ipc backend)."""

    def __init__(self, link: ServerLink, device: torch.device, dialect: str) -> None:
        from asyncgrpo.sync.ipc_sender import IpcSender

        self.link = link
        self.sender = IpcSender(link.client, device=torch.device(device), dialect=dialect)

    def init(self) -> None:
        self.link.run(self.sender.init())

    def push(self, named_tensors: NamedTensors, *, version: str, metas: Sequence[TensorMeta]) -> dict[str, float]:
        return self.link.while_paused(lambda: self.sender.push(named_tensors, version=version, metas=metas))

    def close(self) -> None:
        self.link.run(self.sender.close(), timeout_s=30)


def make_transport(link: ServerLink, device: torch.device, server: ServerDevice | None) -> WeightTransport:
    """The transport `transport_choice.choose_transport` picks for this trainer and server (ValueError:
    a setup that cannot work, with what to restart)."""
    device = torch.device(device)
    uuid = None
    if device.type == "cuda":
        from asyncgrpo.sync.ipc import gpu_uuid

        uuid = gpu_uuid(device)
    host_gpus = torch.cuda.device_count() if device.type == "cuda" else 0
    shared = same_gpu(uuid, server, link.base_url, host_gpus, all_gpus_visible())
    choice = choose_transport(device.type, server, shared)
    logger.info("weight transport: %s (trainer on %s, same GPU as the server: %s)", choice, device, shared)
    hint = sharing_hint(choice, server, os.getpid())
    if hint is not None:  # a warning where the fix is at hand (the embedded server can move in), else a note
        (logger.warning if server.embedded else logger.info)(hint)
    if choice == "ipc":
        return IpcTransport(link, device, "embedded")
    if choice == "vllm_ipc":
        return IpcTransport(link, device, "vllm")
    return CollectiveTransport(link, device, choice)


def push_weights(
    model: torch.nn.Module,
    transport: WeightTransport | None,
    *,
    dtype: torch.dtype,
    version: str,
    bucket_bytes: int = DEFAULT_BUFFER_SIZE_BYTES,
) -> dict[str, float]:
    """Push the model's serving weights, labelled `version`; every rank calls this at the same point.

    `transport` is rank 0's (None on the other ranks). A sharded model is gathered by every rank; a
    replica (DDP) is sent by rank 0 alone and the other ranks return {} at once."""
    if is_sharded(model):
        return push_sharded_weights(model, dtype, transport=transport, version=version, bucket_bytes=bucket_bytes)
    if transport is None:
        return {}
    tensors = weights_for_server(model, dtype)
    try:
        return transport.push(tensors, version=version, metas=server_weight_metas(model, dtype))
    finally:
        tensors.close()  # after a failed push too: runs its end (PEFT adapters are unmerged)


def iter_weight_buckets(
    model: torch.nn.Module, dtype: torch.dtype, bucket_bytes: int
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Every rank, in step: the full weights the server receives (`weights_for_server`), as lists of
    `(name, tensor)` of at most `bucket_bytes` (a bucket may exceed it by its last tensor, like a
    packed chunk). A bucket is released as soon as the consumer asks for the next one."""
    metas = server_weight_metas(model, dtype)
    tensors = weights_for_server(model, dtype)
    for chunk in plan_chunks([m.nbytes for m in metas], bucket_bytes):
        bucket = [next(tensors) for _ in range(chunk.stop - chunk.start)]
        yield bucket
        del bucket
    leftover = next(tensors, None)  # runs the generator's end (PEFT: unmerge)
    assert leftover is None, "weights_for_server yielded more tensors than server_weight_metas announced"


def push_sharded_weights(
    model: torch.nn.Module,
    dtype: torch.dtype,
    *,
    transport: WeightTransport | None,
    version: str,
    bucket_bytes: int,
) -> dict[str, float]:
    """Every rank calls this at the same point; `transport` is rank 0's and None elsewhere.
    Returns rank 0's push timings on every rank."""
    rank, _ = rank_and_world_size()
    buckets = iter_weight_buckets(model, dtype, bucket_bytes)

    def push() -> dict[str, float]:
        assert transport is not None, "rank 0 owns the weight transport"
        stream = _one_by_one(buckets)
        try:
            return transport.push(stream, version=version, metas=server_weight_metas(model, dtype))
        finally:
            _finish_gathers(stream)  # the other ranks wait inside these gathers until all are done

    if rank != 0:
        for bucket in buckets:
            del bucket
    return broadcast_from_rank0(push, f"the weight sync of {version}")


def _one_by_one(buckets: Iterator[list[tuple[str, torch.Tensor]]]) -> Iterator[tuple[str, torch.Tensor]]:
    """The buckets' tensors one at a time, each list emptied as it goes (no reference outlives its chunk)."""
    for bucket in buckets:
        bucket.reverse()
        while bucket:
            yield bucket.pop()


def _finish_gathers(stream: NamedTensors) -> None:
    """Run the remaining gathers of an abandoned (or finished) push so the other ranks get through."""
    try:
        for _ in stream:
            pass
    except ValueError as exc:  # "generator already executing": the push is still running in its thread
        logger.error(
            "could not finish the weight gathers after a failed sync (%s); the other ranks wait until the "
            "process group's timeout",
            exc,
        )
