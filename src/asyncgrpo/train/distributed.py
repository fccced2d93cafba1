"""What the trainer's processes agree on: rank 0 talks to the server and tells the others.

With one process (or no process group) every helper runs locally. A failure on rank 0 is sent to the
other ranks instead of the value, so they raise with its message rather than wait for a collective
that never comes.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

import torch.distributed as dist

if TYPE_CHECKING:
    from asyncgrpo.train.loss import LossStats

T = TypeVar("T")


def rank_and_world_size() -> tuple[int, int]:
    """(rank, world size) of the default process group; (0, 1) without one."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def timed_barrier() -> float:
    """Wait until every process reaches this point; the seconds this one waited (0.0 with one process)."""
    if rank_and_world_size()[1] == 1:
        return 0.0
    start = time.perf_counter()
    dist.barrier()
    return time.perf_counter() - start


def broadcast_from_rank0(compute: Callable[[], T], what: str) -> T:
    """Run `compute` on rank 0 only and return its (picklable) result on every rank. If it raises on
    rank 0, rank 0 raises that error and every other rank a RuntimeError quoting it; `what` names the
    step for that message ("connecting to the inference server")."""
    rank, world_size = rank_and_world_size()
    if world_size == 1:
        return compute()
    if rank == 0:
        try:
            value = compute()
        except BaseException as exc:
            dist.broadcast_object_list([(None, f"{type(exc).__name__}: {exc}")], src=0)
            raise
        dist.broadcast_object_list([(value, None)], src=0)
        return value
    payload: list = [None]
    dist.broadcast_object_list(payload, src=0)
    value, error = payload[0]
    if error is not None:
        raise RuntimeError(f"{what} failed on rank 0: {error} (see rank 0's log)")
    return value


def all_reduce_loss_stats(stats: LossStats) -> LossStats:
    """Loss statistics summed (and min/max-ed) over all processes, in place."""
    if rank_and_world_size()[1] == 1:
        return stats
    for values, op in ((stats.sums, dist.ReduceOp.SUM), (stats.mins, dist.ReduceOp.MIN),
                       (stats.maxs, dist.ReduceOp.MAX)):
        for value in values.values():
            dist.all_reduce(value, op=op)
    return stats
