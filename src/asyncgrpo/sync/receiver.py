"""Server side of the weight transfer: `WeightReceiver` joins the trainer's group and turns the
broadcasts of one `update_weights` call back into named tensors.

    r = WeightReceiver(device=torch.device("cpu"))
    r.init(init_info)                        # POST /init_weight_transfer_engine: blocking
    for name, tensor in r.receive(update_info):   # POST /update_weights: blocking
        model.load_weight(name, tensor)
    metas, info, deltas = r.receive_delta(update_info)   # an update_info with "delta" (sync/delta.py)
    for meta, delta in deltas:
        apply_delta(model.weight(meta.name), delta)
    r.shutdown()

The backend follows `init_info`: `nccl_unique_id_b64` -> NCCL, `"backend": "gloo"` -> gloo. Invalid
bodies raise `ValueError("Invalid init_info: ...")` / `ValueError("Invalid update_info: ...")`
before any collective. `receive` must be consumed to the end: a transfer abandoned half-way leaves
the group out of step, so later calls raise until `shutdown()` and a new `init()`.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import torch

from asyncgrpo.sync.communicator import Communicator
from asyncgrpo.sync.delta import DeltaInfo, TensorDelta, delta_wire_metas, split_wire
from asyncgrpo.sync.packed import TensorMeta, TransferInit, metas_from_update_info, plan_chunks, unpack

logger = logging.getLogger(__name__)


class WeightReceiver:
    """One server worker's end of the transfer group. `worker_index` is this worker's index among
    the server's workers (its rank is `rank_offset + worker_index`); `timeout_s` bounds every
    blocking step."""

    def __init__(self, device: torch.device, *, timeout_s: float = 1800.0, worker_index: int = 0) -> None:
        self.device = torch.device(device)
        self.timeout_s = timeout_s
        self.worker_index = worker_index
        self.config: TransferInit | None = None
        self._comm: Communicator | None = None
        self._last_metas: list[TensorMeta] | None = None
        self._broken: str | None = None

    @property
    def initialized(self) -> bool:
        return self._comm is not None

    def init(self, init_info: dict[str, Any]) -> None:
        """Validate `init_info`, join the group as rank `rank_offset + worker_index`, and run the
        protocol's warm-up all-reduce (one float32 zero, summed)."""
        config = TransferInit.from_init_info(init_info)
        rank = config.rank_offset + self.worker_index
        if rank >= config.world_size:
            raise ValueError(
                f"Invalid init_info: rank_offset {config.rank_offset} + worker {self.worker_index} does not "
                f"fit in world_size {config.world_size}"
            )
        if self._comm is not None:
            raise RuntimeError(
                "weight transfer is already initialised; shut it down before initialising again"
            )
        if config.backend == "nccl":
            from asyncgrpo.sync.nccl import NcclCommunicator

            assert config.nccl_unique_id is not None
            comm: Communicator = NcclCommunicator(
                config.nccl_unique_id,
                rank=rank,
                world_size=config.world_size,
                device=self.device,
                timeout_s=self.timeout_s,
            )
        else:
            from asyncgrpo.sync.gloo import GlooCommunicator

            assert config.master_address is not None and config.master_port is not None
            comm = GlooCommunicator(
                master_address=config.master_address,
                master_port=config.master_port,
                rank=rank,
                world_size=config.world_size,
                timeout_s=self.timeout_s,
            )
        try:
            warmup = torch.zeros(1, dtype=torch.float32, device=self.device)
            comm.all_reduce_sum_(warmup)
            comm.synchronize()
        except BaseException:
            comm.close()
            raise
        self._comm, self.config, self._broken, self._last_metas = comm, config, None, None
        logger.info(
            "weight transfer joined: backend %s, rank %d of %d, packed %s",
            config.backend,
            rank,
            config.world_size,
            config.packed,
        )

    def receive(self, update_info: Any) -> Iterator[tuple[str, torch.Tensor]]:
        """Validate `update_info` now and return an iterator that receives and yields each
        `(name, tensor)` in `names` order (declared dtype and shape, on `device`). Three empty
        lists reuse the previous update's metadata."""
        self._check_ready()
        metas = metas_from_update_info(update_info)
        if not metas:
            if self._last_metas is None:
                raise ValueError(
                    "Invalid update_info: empty lists reuse the previous metadata, but there is none yet"
                )
            metas = self._last_metas
        self._last_metas = metas
        return self._receive(metas)

    def receive_delta(
        self, update_info: Any
    ) -> tuple[list[TensorMeta], DeltaInfo, Iterator[tuple[TensorMeta, TensorDelta]]]:
        """Validate a delta update (an update_info with a `delta` object, `asyncgrpo.sync.delta`) now and
        return every tensor's meta, the delta's description, and an iterator that receives the
        broadcast and yields `(meta, TensorDelta)` for each tensor something was sent for (an
        unchanged one is not yielded). As with `receive`, consume it to the end."""
        self._check_ready()
        if not isinstance(update_info, dict) or "delta" not in update_info:
            raise ValueError("Invalid update_info: a delta update needs a 'delta' object")
        metas = metas_from_update_info({k: v for k, v in update_info.items() if k != "delta"})
        if not metas:
            raise ValueError("Invalid update_info: a delta update names every tensor it describes")
        info = DeltaInfo.from_json(update_info["delta"], metas)
        self._last_metas = metas
        wire = self._receive(delta_wire_metas(metas, info))
        return metas, info, split_wire(metas, info, (tensor for _, tensor in wire))

    def _check_ready(self) -> None:
        if self._comm is None or self.config is None:
            raise RuntimeError("weight transfer is not initialised: call init_weight_transfer_engine first")
        if self._broken is not None:
            raise RuntimeError(
                f"weight transfer group is out of step ({self._broken}); shut it down and initialise again"
            )

    def _receive(self, metas: list[TensorMeta]) -> Iterator[tuple[str, torch.Tensor]]:
        comm, config = self._comm, self.config
        assert comm is not None and config is not None
        finished = False
        try:
            if config.packed:
                for chunk in plan_chunks([m.nbytes for m in metas], config.buffer_size_bytes):
                    buffer = torch.empty(chunk.nbytes, dtype=torch.uint8, device=self.device)
                    comm.broadcast_(buffer, 0)
                    comm.synchronize()
                    chunk_metas = metas[chunk.start : chunk.stop]
                    for meta, tensor in zip(chunk_metas, unpack(buffer, chunk_metas, chunk.offsets)):
                        yield meta.name, tensor
            else:
                for meta in metas:
                    tensor = torch.empty(meta.shape, dtype=meta.dtype, device=self.device)
                    comm.broadcast_(tensor, 0)
                    comm.synchronize()
                    yield meta.name, tensor
            finished = True
        finally:
            if not finished:
                self._broken = "an update was not received to the end"

    def end_update(self) -> None:
        """An update finished (nothing to release: received buffers are the server's own)."""

    def shutdown(self) -> None:
        comm, self._comm = self._comm, None
        self.config, self._last_metas, self._broken = None, None, None
        if comm is not None:
            comm.close()
