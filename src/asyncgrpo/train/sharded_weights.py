"""Weight sync of a sharded (FSDP2) model: every rank gathers, rank 0 sends, bucket by bucket.

    every rank    for each bucket of `plan_chunks(sizes, bucket_bytes)`     (same buckets, same order)
                      full_tensor() of each of its parameters               (one all-gather each)
    rank 0            hands the bucket to the sender, which packs it into one chunk and broadcasts it
    other ranks       drop it at once
    every rank    rank 0 broadcasts whether the push went through; a failure raises on every rank

The buckets are the sender's chunks (the same plan over the same sizes), so rank 0 holds at most one
bucket of gathered tensors plus its packed copy, never the whole model; the other ranks hold one
tensor. If the push fails part-way, rank 0 still gathers the remaining buckets (the other ranks are
inside those very collectives) before it reports the failure, so no rank waits on a collective that
never comes. The plain path (one process, or DDP, where rank 0 holds the full model) does not come
here: rank 0 sends alone.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import torch

from asyncgrpo.sync.packed import plan_chunks
from asyncgrpo.train.distributed import broadcast_from_rank0, rank_and_world_size
from asyncgrpo.train.model_setup import server_weight_metas, weights_for_server

logger = logging.getLogger(__name__)


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
    link: Any,
    version: str,
    bucket_bytes: int,
) -> dict[str, float]:
    """Every rank calls this at the same point; `link` (a `ServerLink`) is rank 0's and None elsewhere.
    Returns rank 0's sync timings (`ServerLink.sync_weights`) on every rank."""
    rank, _ = rank_and_world_size()
    buckets = iter_weight_buckets(model, dtype, bucket_bytes)

    def push() -> dict[str, float]:
        assert link is not None, "rank 0 owns the server link"
        stream = _one_by_one(buckets)
        try:
            return link.sync_weights(lambda: stream, version=version, metas=server_weight_metas(model, dtype))
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


def _finish_gathers(stream: Iterator[Any]) -> None:
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
