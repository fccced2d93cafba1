"""The collective transport: the server's weight-transfer group, over NCCL from a CUDA trainer or gloo
from a CPU one (vllm-protocol.md section 5). It owns rank 0's `asyncgrpo.sync.sender.WeightSender`;
`ServerLink` gives it the HTTP client, its event loop and the pause.

    init()   WeightSender.init: GET /get_world_size, POST /init_weight_transfer_engine || join the group
    send()   link.while_paused:  POST /pause?mode=keep
                                 WeightSender.push: start / update_weights || broadcast chunks / finish
                                 POST /resume
    close()  leave the group (`init()` forms a new one: what restart recovery does)

With `delta` (`weight_push="delta"`, a server that takes deltas) it keeps `LastPush`, the copy of the
weights the server holds (delta.py), and a push sends only the words changed since the last one:

    send()   LastPush.advance: the copy takes the new weights, the delta comes back     (not paused)
             link.while_paused:  GET /weight_info == the version of the last push
                                   -> WeightSender.push_delta     (refused, 412 -> the full push below)
                                 otherwise -> WeightSender.push of the copy (the first push, a new group)

NCCL refuses two ranks on one GPU: a trainer on the server's GPU gets an error naming CUDA IPC
(`ipc.py`), which `choose.py` picks by itself when it knows the two share a GPU.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import torch

from asyncgrpo.sync.delta import DeltaUpdate
from asyncgrpo.sync.packed import DEFAULT_BUFFER_SIZE_BYTES, TensorMeta
from asyncgrpo.train.server_link import ServerLink
from asyncgrpo.train.weights.base import FullWeights
from asyncgrpo.train.weights.delta import LastPush
from asyncgrpo.train.weights.gather import NamedTensors
from asyncgrpo.train.weights.ipc import INSECURE_RISK, VLLM_IPC_RESTART

logger = logging.getLogger(__name__)


class CollectiveTransport(FullWeights):
    """Rank 0 of the server's weight-transfer group; `backend` "nccl" or "gloo" (default: NCCL from a
    CUDA `device`, gloo from the CPU). `device` is where the chunks are packed and sent from, and where
    the copy of the last push lives with `delta` (module docstring)."""

    def __init__(self, link: ServerLink, device: torch.device, dtype: torch.dtype, backend: str | None = None,
                 *, bucket_bytes: int = DEFAULT_BUFFER_SIZE_BYTES, delta: bool = False) -> None:
        super().__init__(dtype, bucket_bytes)
        self.link = link
        self.device = torch.device(device)
        self.backend = backend or ("nccl" if self.device.type == "cuda" else "gloo")
        self.sender = None  # the WeightSender, while the group is formed
        self.last = LastPush(self.device) if delta else None

    def init(self) -> None:
        """Form the group (raises with the fix when NCCL refuses it)."""
        from asyncgrpo.sync.gloo import address_toward
        from asyncgrpo.sync.sender import WeightSender

        address = address_toward(self.link.base_url) if self.backend == "gloo" else "127.0.0.1"
        self.sender = WeightSender(self.link.client, backend=self.backend, device=self.device,
                                   buffer_size_bytes=self.bucket_bytes, timeout_s=self.link.timeout_s,
                                   master_address=address)
        if self.last is not None:  # a new group (a restarted server): the next push is full
            self.last.forget()
        try:
            self.link.run(self.sender.init())
        except RuntimeError as exc:
            hint = nccl_failure_hint(str(exc)) if self.backend == "nccl" else None
            if hint is None:
                raise
            raise RuntimeError(f"{exc}\n{hint}") from exc

    def send(self, named_tensors: NamedTensors, *, label: str,
             metas: Sequence[TensorMeta] | None = None) -> dict[str, float]:
        """Pause (keep), broadcast, resume (`ServerLink.while_paused`); also returns the transfer's size
        (`bytes`, `num_chunks`) and, with `delta`, whether it was a delta (`delta` 1.0 or 0.0) and the
        time taken to encode it before pausing (`encode_s`, part of `total_s`)."""
        assert self.sender is not None, "init() must run before a push"
        sender, last = self.sender, self.last
        if last is None:
            return self.link.while_paused(lambda: sender.push(named_tensors, version=label, metas=metas))
        if metas is None:
            tensors = list(named_tensors)
            metas, named_tensors = [TensorMeta.of(name, t) for name, t in tensors], iter(tensors)
        t0 = time.perf_counter()
        update = last.advance(named_tensors, metas)
        encode_s = time.perf_counter() - t0
        try:
            timings = self.link.while_paused(lambda: self._push(update, label, metas))
        except BaseException:
            last.forget()
            raise
        last.label = label
        return {**timings, "encode_s": encode_s, "total_s": timings["total_s"] + encode_s}

    async def _push(self, update: DeltaUpdate | None, label: str,
                    metas: Sequence[TensorMeta]) -> dict[str, float]:
        """The delta when the server holds its base and it is smaller, else the copy in full."""
        from asyncgrpo.sync.sender import DeltaRejected

        assert self.sender is not None and self.last is not None
        if update is not None and update.nbytes < update.full_nbytes:
            held = await self.link.client.weight_info()
            if held == update.base_version:
                try:
                    return {**await self.sender.push_delta(update, version=label), "delta": 1.0}
                except DeltaRejected as exc:
                    logger.warning("the server refused the weight delta (%s): pushing the full weights", exc)
            else:
                logger.warning("the server serves weight version %r, not %r that this trainer pushed last: "
                               "pushing the full weights", held, update.base_version)
        elif update is not None:
            logger.debug("the weight delta of %s would be no smaller than the full weights: pushing those",
                         label)
        pushed = await self.sender.push(self.last.named_tensors(metas), version=label, metas=metas)
        return {**pushed, "delta": 0.0}

    def close(self) -> None:
        """Leave the group (`init()` forms a new one)."""
        sender, self.sender = self.sender, None
        if sender is not None and self.link.is_open():
            self.link.run(sender.close(), timeout_s=30)

    def __str__(self) -> str:
        return f"CollectiveTransport({self.backend})"


def nccl_failure_hint(message: str) -> str | None:
    """What to tell the user when NCCL could not form the group: two ranks on one GPU are refused."""
    if "invalid usage" not in message:
        return None
    return (
        "NCCL refuses two ranks on one GPU: the server most likely runs on the trainer's GPU. Use CUDA IPC "
        f"instead: for vLLM restart it as `{VLLM_IPC_RESTART}` (risk: {INSECURE_RISK}); the embedded server "
        "does it by itself when it reports its GPU (`asyncgrpo serve` of this version)"
    )
