"""An inference server that restarts during training gets the trained weights back, and training goes on.

A server brought back on the same address (by a supervisor, a container runtime, a person) serves the
weights it loaded at start, under the initial weight version (`"default"`), and has lost the trainer's
weight-transfer group. Both processes find out:

    rollout process   its tokens come back labelled "default" -> dropped, the request asked again once
                      the server serves pushed weights (`GenerationClient.generate`)
    trainer           a push fails and /weight_info says "default"  -> `ServerRestartedError` from the link
                      or, while it waits for samples, /weight_info says "default" (checked every few seconds)
                      -> close the transport, set it up again, push the current weights

so no token of the initial weights is trained on, and neither side waits for the other. The server must be
back within the requests' retries (5, about 20 s in all) or within `vllm_server_restart_timeout`, which both
processes' clients wait for it (`generation/transport.py`); one that takes longer stops the run as a dead
server does. With several
training processes the push is collective and the wait is rank 0's alone: there the restart is an
error (resume from the last checkpoint). Adapter-only LoRA sync has no transport to set up again and is
not watched (the restarted server has none of its adapters).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from asyncgrpo.generation.client import ServerRestartedError
from asyncgrpo.train.server_link import ServerLink
from asyncgrpo.train.weight_push import WeightTransport

logger = logging.getLogger(__name__)

CHECK_EVERY_S = 5.0  # while the trainer waits for samples


class ServerRestarts:
    """Full-weight pushes that survive a restarted server (one training process)."""

    def __init__(self, link: ServerLink, transport: WeightTransport, push: Callable[[str], dict[str, float]],
                 *, world_size: int) -> None:
        """push(version): one full push through `transport` (what `push_weights` does)."""
        self.link = link
        self.transport = transport
        self._push = push
        self.world_size = world_size
        self.recoveries = 0
        self._checked_at = time.monotonic()

    def push(self, version: str) -> dict[str, float]:
        try:
            return self._push(version)
        except ServerRestartedError:
            return self.recover(version)

    def check(self, version: str) -> None:
        """While the trainer waits for samples: a restarted server gets the weights `version` now (its
        rollouts wait for them). At most every CHECK_EVERY_S."""
        now = time.monotonic()
        if now - self._checked_at < CHECK_EVERY_S:
            return
        self._checked_at = now
        if self.link.restarted():
            self.recover(version)

    def recover(self, version: str) -> dict[str, float]:
        if self.world_size > 1:
            raise ServerRestartedError(
                self.link.base_url, f"serves weights no trainer pushed, and {self.world_size} training processes "
                "cannot push them again mid-step"
            )
        logger.warning(
            "the inference server at %s restarted (it serves the weights it loaded at start): setting up the weight "
            "transfer again and pushing the trained weights (%s); nothing it generated from its initial weights is "
            "trained on", self.link.base_url, version,
        )
        self.transport.close()
        self.transport.init()
        timings = self._push(version)
        self.recoveries += 1
        logger.warning("the inference server at %s serves the trained weights again (%s)", self.link.base_url, version)
        return timings
