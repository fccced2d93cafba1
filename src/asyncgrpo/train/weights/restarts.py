"""An inference server that restarts during training gets the trained weights back, and training goes on.

A server brought back on the same address (by a supervisor, a container runtime, a person) serves the
weights it loaded at start, under the initial weight version (`"default"`), and has lost the trainer's
weight-transfer group. Both processes find out:

    rollout process   its tokens come back labelled "default" -> dropped, the request asked again once
                      the server serves pushed weights (`GenerationClient.generate`)
    trainer           a push fails and /weight_info says "default"  -> `ServerRestartedError` from the link
                      or, while it waits for samples (`idle`), /weight_info says "default" (checked every
                      few seconds)
                      -> close the transport, set it up again, push the current weights

so no token of the initial weights is trained on, and neither side waits for the other. The server must be
back within the requests' retries (5, about 20 s in all) or within `vllm_server_restart_timeout`, which both
processes' clients wait for it (`generation/transport.py`); one that takes longer stops the run as a dead
server does. With several training processes the push is collective and the wait is rank 0's alone: there
the restart is an error (resume from the last checkpoint). Adapter-only LoRA sync is not wrapped (the
restarted server has none of its adapters, and there is no transfer to set up again).

`ServerRestarts` is a transport wrapping the full-weight transport it recovers (`choose.make_transport`
builds it); the weights pushed back are the model's current ones, labelled with the current version
(with `weight_sync_steps` > 1 they may have trained past it; the rollouts count them as that version).
"""

from __future__ import annotations

import logging
import time

import torch

from asyncgrpo.generation.client import ServerRestartedError
from asyncgrpo.train.server_link import ServerLink
from asyncgrpo.train.weights.base import WeightTransport
from asyncgrpo.types import WeightVersion

logger = logging.getLogger(__name__)

CHECK_EVERY_S = 5.0  # while the trainer waits for samples


class ServerRestarts:
    """Full-weight pushes through `transport` that survive a restarted server (one training process)."""

    def __init__(self, transport: WeightTransport, link: ServerLink, *, world_size: int) -> None:
        self.transport = transport
        self.link = link
        self.world_size = world_size
        self.recoveries = 0
        self._checked_at = time.monotonic()

    @property
    def lora_name(self) -> str | None:
        return self.transport.lora_name

    def init(self) -> None:
        self.transport.init()

    def push(self, model: torch.nn.Module, version: WeightVersion) -> dict[str, float]:
        try:
            return self.transport.push(model, version)
        except ServerRestartedError:
            return self.recover(model, version)

    def idle(self, model: torch.nn.Module, version: WeightVersion) -> None:
        """While the trainer waits for samples: a restarted server gets the weights `version` now (its
        rollouts wait for them). At most every CHECK_EVERY_S."""
        self.transport.idle(model, version)
        now = time.monotonic()
        if now - self._checked_at < CHECK_EVERY_S:
            return
        self._checked_at = now
        if self.link.restarted():
            self.recover(model, version)

    def recover(self, model: torch.nn.Module, version: WeightVersion) -> dict[str, float]:
        if self.world_size > 1:
            raise ServerRestartedError(
                self.link.base_url, f"serves weights no trainer pushed, and {self.world_size} training "
                "processes cannot push them again mid-step"
            )
        label = WeightVersion(version).label()
        logger.warning(
            "the inference server at %s restarted (it serves the weights it loaded at start): setting up "
            "the weight transfer again and pushing the trained weights (%s); nothing it generated from its "
            "initial weights is "
            "trained on", self.link.base_url, label,
        )
        self.transport.close()
        self.transport.init()
        timings = self.transport.push(model, version)
        self.recoveries += 1
        logger.warning(
            "the inference server at %s serves the trained weights again (%s)", self.link.base_url, label
        )
        return timings

    def close(self) -> None:
        self.transport.close()

    def __str__(self) -> str:
        return str(self.transport)
