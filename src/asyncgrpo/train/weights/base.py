"""What a weight transport does for the trainer, and the base of those that send the full weights.

    trainer (every rank)                             WeightTransport
    train():        make_transport(...), then init()  rank 0: set up the server's side (group, adapters)
    rollouts:       lora_name                          None (the served model's name), or the adapter's
    each sync:      push(model, version) -> timings   the server serves `model` as `version`
    waiting:        idle(model, version)               a chance to repair the server (restarts.py)
    end:            close()                            idempotent

`push` takes the model, not tensors: each transport takes from it what it sends (the full serving
weights through `gather.push_weights`, or the LoRA adapter alone), so the trainer never asks which
kind it holds. Every rank calls `push` at the same point: FSDP2's gathers need every rank; rank 0
alone talks to the server, and the other ranks hold an `OtherRank`. The timings feed the
`perf/weight_sync_*` metrics: `total_s`, `pause_s`, `transfer_s`, `resume_s`, and the size (`bytes`,
`num_chunks`), plus what a transport adds (`write_s`, `load_s`). A push that raises leaves the server
resumed (DESIGN section 7) and the trainer's version where it was.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Protocol

import torch

from asyncgrpo.sync.packed import DEFAULT_BUFFER_SIZE_BYTES, TensorMeta
from asyncgrpo.train.weights.gather import NamedTensors, push_weights
from asyncgrpo.types import WeightVersion


class WeightTransport(Protocol):
    """Moves the trainer's weights into the inference server (module docstring)."""

    lora_name: str | None
    """What rollouts ask the server for (`AsyncRolloutLoop(lora_name=...)`): None when the pushed weights
    replace the served model's, else the adapter name of each version, "{version}" to fill."""

    def init(self) -> None:
        """Set up the channel to the server (once, before the first push)."""

    def push(self, model: torch.nn.Module, version: WeightVersion) -> dict[str, float]:
        """Make the server serve `model`'s weights as `version`; every rank calls it at the same point.
        Returns the time split and size for perf/weight_sync_* (rank 0's; {} where nothing was timed)."""

    def idle(self, model: torch.nn.Module, version: WeightVersion) -> None:
        """Called while the trainer waits for samples (often): most transports do nothing."""

    def close(self) -> None:
        """Release the channel (idempotent)."""


class FullWeights(ABC):
    """A transport that sends every weight the server holds (`gather.weights_for_server`): `push`
    gathers them (FSDP2 bucket by bucket) and `send`, the transport's own part, moves them.

    dtype: the serving dtype the tensors are cast to. bucket_bytes: the FSDP2 bucket, the sender's
    chunk size (so a bucket is one packed chunk)."""

    lora_name: str | None = None  # the served model's weights are replaced

    def __init__(self, dtype: torch.dtype, bucket_bytes: int = DEFAULT_BUFFER_SIZE_BYTES) -> None:
        self.dtype = dtype
        self.bucket_bytes = bucket_bytes

    def push(self, model: torch.nn.Module, version: WeightVersion) -> dict[str, float]:
        label = WeightVersion(version).label()
        return push_weights(model, lambda tensors, metas: self.send(tensors, label=label, metas=metas),
                            dtype=self.dtype, label=label, bucket_bytes=self.bucket_bytes)

    @abstractmethod
    def send(self, named_tensors: NamedTensors, *, label: str,
             metas: Sequence[TensorMeta] | None = None) -> dict[str, float]:
        """One full update labelled `label` (the server's weight version). With `metas` (name, dtype and
        full shape of every tensor, in order) `named_tensors` yields exactly those and is pulled lazily;
        without, it is read whole first. Returns the timings (module docstring)."""

    def init(self) -> None:
        """Nothing to set up (a transport with a channel overrides this)."""

    def idle(self, model: torch.nn.Module, version: WeightVersion) -> None:
        """Nothing to do while the trainer waits."""

    def close(self) -> None:
        """Nothing to release (a transport with a channel overrides this)."""


class OtherRank(FullWeights):
    """The transport of a training process other than rank 0: it sends nothing (rank 0 sends the same
    weights), and takes part in a sharded model's gathers. Its push returns rank 0's timings for a
    sharded model, {} for a replica."""

    def push(self, model: torch.nn.Module, version: WeightVersion) -> dict[str, float]:
        label = WeightVersion(version).label()
        return push_weights(model, None, dtype=self.dtype, label=label, bucket_bytes=self.bucket_bytes)

    def send(self, named_tensors: NamedTensors, *, label: str,
             metas: Sequence[TensorMeta] | None = None) -> dict[str, float]:
        raise AssertionError("only rank 0 sends weights to the server")

    def __str__(self) -> str:
        return "OtherRank"
