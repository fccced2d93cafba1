"""The full weights the server receives, gathered from the trained model: names, metas, FSDP2 buckets.

    push_weights(model, send, dtype, label)         every rank calls it at the same point
      |- one process, or DDP (rank 0 holds the full model): rank 0 sends weights_for_server(model)
      |- FSDP2 (is_sharded): every rank gathers bucket by bucket, rank 0 sends (see below)
      '- send(named tensors, metas) -> timings for perf/weight_sync_*   (rank 0's; None on the others)

`weights_for_server` yields (Hugging Face checkpoint name, full tensor in the serving dtype) for every
weight the server holds, in the order `server_weight_metas` announces without gathering anything: a
PEFT model merged for the copy only, a vision-language model's text model only (its vision tower and
projector are frozen, and the server keeps what it loaded from the checkpoint).

Sharded (FSDP2) models:

    every rank    for each bucket of `plan_chunks(sizes, bucket_bytes)`     (same buckets, same order)
                      full_tensor() of each of its parameters               (one all-gather each)
    rank 0            hands the bucket to `send`, whose transport packs it into one chunk and sends it
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
from collections.abc import Callable, Iterator, Sequence

import torch

from asyncgrpo.modeling.load import is_vision_language
from asyncgrpo.sync.packed import DEFAULT_BUFFER_SIZE_BYTES, TensorMeta, plan_chunks
from asyncgrpo.train.distributed import broadcast_from_rank0, rank_and_world_size
from asyncgrpo.train.model_setup import text_parameter_ids, unwrap

logger = logging.getLogger(__name__)

NamedTensors = Iterator[tuple[str, torch.Tensor]]
Send = Callable[[NamedTensors, Sequence[TensorMeta]], dict[str, float]]
"""Rank 0's end of a push: (named tensors, exactly those `metas` in order, pulled lazily) -> timings."""


def _server_parameters(model: torch.nn.Module) -> Iterator[tuple[str, torch.nn.Parameter]]:
    """(checkpoint name, parameter) of every weight the server holds, in `named_parameters` order (tied
    weights once); of a vision-language model, its text model's only. PEFT: adapter factors are
    skipped (they are merged into the base weights) and wrapper names are mapped back to the
    checkpoint's."""
    base = unwrap(model)
    is_peft = base is not model and hasattr(model, "merge_adapter")
    text = text_parameter_ids(base) if is_vision_language(base.config) else None
    for name, param in base.named_parameters():
        if text is not None and id(param) not in text:
            continue  # a vision-language model's vision tower and projector: frozen, the server keeps its own
        if is_peft:
            if "lora_" in name or ".original_module." in name:
                continue  # adapter factors are merged; the trained copy replaces the original
            name = name.replace(".base_layer.", ".").replace(".modules_to_save.default.", ".")
        yield name, param


def server_weight_metas(model: torch.nn.Module, dtype: torch.dtype) -> list[TensorMeta]:
    """Name, serving dtype and full (unsharded) shape of every tensor `weights_for_server` yields, in
    its order, without gathering anything (a sharded parameter reports its global shape)."""
    return [TensorMeta(name, dtype, tuple(param.shape)) for name, param in _server_parameters(model)]


def is_sharded(model: torch.nn.Module) -> bool:
    """Whether the model's parameters are DTensors (FSDP2): gathering them takes every rank."""
    return any(_is_dtensor(p) for p in model.parameters())


def weights_for_server(model: torch.nn.Module, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    """(checkpoint name, full tensor in the serving dtype) for every weight the server must hold.

    Names are Hugging Face checkpoint names (`model.layers.0.self_attn.q_proj.weight`). A PEFT model
    is sent merged: LoRA deltas are folded into the base weights for the copy only, the trained
    model keeps its adapter. A sharded (FSDP2) parameter is cast to `dtype` on its shard, then
    gathered (`full_tensor()`, one all-gather): with a sharded model, every rank must iterate this
    to the end, in step (`push_weights`).
    """
    base = unwrap(model)
    is_peft = base is not model and hasattr(model, "merge_adapter")
    if is_peft:
        model.merge_adapter()
    try:
        for name, param in _server_parameters(model):
            tensor = param.detach().to(dtype)
            if _is_dtensor(tensor):
                tensor = tensor.full_tensor()
            elif is_peft and tensor.data_ptr() == param.data_ptr():
                tensor = tensor.clone()  # a view of a merged weight would read unmerged values once unmerged
            yield name, tensor.contiguous()
    finally:
        if is_peft:
            model.unmerge_adapter()


def _is_dtensor(tensor: torch.Tensor) -> bool:
    if not torch.distributed.is_available():
        return False
    from torch.distributed.tensor import DTensor

    return isinstance(tensor, DTensor)


def push_weights(
    model: torch.nn.Module,
    send: Send | None,
    *,
    dtype: torch.dtype,
    label: str,
    bucket_bytes: int = DEFAULT_BUFFER_SIZE_BYTES,
) -> dict[str, float]:
    """Push the model's serving weights through `send`; every rank calls this at the same point.

    `send` is rank 0's (None on the other ranks); `label` names the push in a failure's message. A
    sharded model is gathered by every rank; a replica (DDP) is sent by rank 0 alone and the other
    ranks return {} at once."""
    if is_sharded(model):
        return push_sharded_weights(model, dtype, send=send, label=label, bucket_bytes=bucket_bytes)
    if send is None:
        return {}
    tensors = weights_for_server(model, dtype)
    try:
        return send(tensors, server_weight_metas(model, dtype))
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
    send: Send | None,
    label: str,
    bucket_bytes: int,
) -> dict[str, float]:
    """Every rank calls this at the same point; `send` is rank 0's and None elsewhere.
    Returns rank 0's push timings on every rank."""
    rank, _ = rank_and_world_size()
    buckets = iter_weight_buckets(model, dtype, bucket_bytes)

    def push() -> dict[str, float]:
        assert send is not None, "rank 0 owns the weight transport"
        stream = _one_by_one(buckets)
        try:
            return send(stream, server_weight_metas(model, dtype))
        finally:
            _finish_gathers(stream)  # the other ranks wait inside these gathers until all are done

    if rank != 0:
        for bucket in buckets:
            del bucket
    return broadcast_from_rank0(push, f"the weight sync of {label}")


def _one_by_one(buckets: Iterator[list[tuple[str, torch.Tensor]]]) -> NamedTensors:
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
