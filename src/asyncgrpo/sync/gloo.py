"""Weight-transfer communicator over gloo, for the embedded server on CPU (same host).

It is a standalone `torch.distributed.ProcessGroupGloo(store, rank, size, ...)`: there is NO global
`init_process_group`, so it never clashes with the trainer's default (FSDP) group. The trainer
(rank 0) hosts a `TCPStore` on `master_address:master_port`; server workers connect to it as
clients and join with rank `rank_offset + i`. The `init_info` the server receives is

    {"backend": "gloo", "master_address": str, "master_port": int, "rank_offset": 1,
     "world_size": W + 1, "packed": bool, "packed_buffer_size_bytes": int}

Every operation is blocking and bounded by `timeout_s` (gloo raises when it runs out). Tensors on
another device are staged through CPU.
"""

from __future__ import annotations

import datetime
import ipaddress
import logging
import socket
import urllib.parse

import torch
from torch.distributed import (
    AllreduceOptions,
    BroadcastOptions,
    PrefixStore,
    ProcessGroupGloo,
    ReduceOp,
    TCPStore,
)

logger = logging.getLogger(__name__)

_STORE_PREFIX = "asyncgrpo/weight_transfer"


def host_store(master_address: str, timeout_s: float) -> TCPStore:
    """Rank 0: listen on a free port of `master_address` (read it back from `.port`)."""
    return TCPStore(
        master_address,
        0,
        is_master=True,
        timeout=datetime.timedelta(seconds=timeout_s),
        wait_for_workers=False,
    )


def is_loopback_host(host: str) -> bool:
    """`host` (a name or an address) resolves to a loopback address of this machine; False when it
    does not resolve."""
    try:
        return ipaddress.ip_address(socket.getaddrinfo(host, None)[0][4][0]).is_loopback
    except (OSError, ValueError):
        return False


def address_toward(server_url: str) -> str:
    """The address of this host that a server at `server_url` reaches it at: 127.0.0.1 for a server on
    this host (or one whose name does not resolve here: the requests will say so), else the address of
    the interface the route to the server leaves by (a UDP `connect` sends nothing; it only picks the
    route). Rank 0 hosts the group's store there."""
    host = urllib.parse.urlsplit(server_url).hostname or "127.0.0.1"
    if is_loopback_host(host):
        return "127.0.0.1"
    try:
        family, _, _, _, sockaddr = socket.getaddrinfo(host, None, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect((sockaddr[0], 9))
            return probe.getsockname()[0]
    except OSError:
        return "127.0.0.1"


def _device_for(address: str) -> ProcessGroupGloo.Device:
    if is_loopback_host(address):
        return ProcessGroupGloo.create_device(hostname="127.0.0.1")
    return ProcessGroupGloo.create_default_device()


class GlooCommunicator:
    """rank/world_size of a standalone gloo group. Construct it on every rank at the same time; the
    constructor blocks until all `world_size` ranks joined (or `timeout_s` passes)."""

    def __init__(
        self,
        *,
        master_address: str,
        master_port: int,
        rank: int,
        world_size: int,
        timeout_s: float,
        store: TCPStore | None = None,
    ) -> None:
        timeout = datetime.timedelta(seconds=timeout_s)
        self.rank = rank
        self.world_size = world_size
        self._timeout = timeout
        try:
            if store is None:  # a dead or wrong address fails here, after timeout_s of retries
                store = TCPStore(master_address, master_port, is_master=False, timeout=timeout)
            self._store = store
            options = ProcessGroupGloo._Options()
            options._devices = [_device_for(master_address)]
            options._timeout = timeout
            self._pg = ProcessGroupGloo(PrefixStore(_STORE_PREFIX, store), rank, world_size, options)
        except RuntimeError as exc:  # DistStoreError and DistNetworkError are RuntimeErrors
            raise RuntimeError(
                f"gloo weight-transfer group: rank {rank}/{world_size} could not join via "
                f"{master_address}:{master_port} within {timeout_s:.0f}s ({exc}); check that every rank "
                "was started and that the address is reachable"
            ) from exc
        logger.debug("gloo group up: rank %d of %d", rank, world_size)

    def _cpu(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor if tensor.device.type == "cpu" else tensor.cpu()

    def all_reduce_sum_(self, tensor: torch.Tensor) -> None:
        """In-place sum over all ranks."""
        staged = self._cpu(tensor)
        opts = AllreduceOptions()
        opts.reduceOp = ReduceOp.SUM
        opts.timeout = self._timeout
        self._pg.allreduce([staged], opts).wait()
        if staged is not tensor:
            tensor.copy_(staged)

    def broadcast_(self, tensor: torch.Tensor, src: int = 0) -> None:
        """In-place broadcast from `src` (blocking: returns when this rank's part is done). The bytes
        travel as uint8, so every dtype (float8 included) is carried unchanged."""
        staged = self._cpu(tensor).contiguous()
        opts = BroadcastOptions()
        opts.rootRank = src
        opts.rootTensor = 0
        opts.timeout = self._timeout
        self._pg.broadcast([staged.reshape(-1).view(torch.uint8)], opts).wait()
        if staged is not tensor:
            tensor.copy_(staged)

    def synchronize(self) -> None:
        """Collectives are synchronous here."""

    def close(self) -> None:
        pg, self._pg = getattr(self, "_pg", None), None
        if pg is not None:
            try:
                pg.abort()
            except (RuntimeError, AttributeError) as exc:  # dropping the reference closes it too
                logger.debug("gloo abort not available: %s", exc)
        self._store = None
