"""Rank 0's handle on the rollout process for one `train()` call.

    RolloutProcess(loop_cls, loop_kwargs, ...)   spawn it over a fresh RolloutChannel
    check_health()                               raise its error, or a hang, in the trainer
    metrics() / completions()                    what it reported since the last call
    publish(token_allowance=, model_version=)    what it may generate next, and under which weights
    stop()                                       always, at the end of train()

The channel itself (queues and shared values) is `asyncgrpo.rollout.channel`; the process shell
(spawn, heartbeat, stop escalation) is `asyncgrpo.rollout.worker`.
"""

from __future__ import annotations

import multiprocessing as mp
from typing import Any

from asyncgrpo.metrics import MetricRecord
from asyncgrpo.rollout.channel import RolloutChannel
from asyncgrpo.rollout.loop import AsyncRolloutLoop
from asyncgrpo.rollout.worker import RolloutWorker
from asyncgrpo.train.completions_table import drain
from asyncgrpo.types import WeightVersion


class RolloutProcess:
    """The spawned `AsyncRolloutLoop` and the channel the trainer shares with it."""

    def __init__(
        self,
        loop_cls: type[AsyncRolloutLoop],
        loop_kwargs: dict[str, Any],
        *,
        initial_allowance: int,
        model_version: WeightVersion,
        log_completions: bool,
    ) -> None:
        self.channel = RolloutChannel.create(
            mp.get_context("spawn"), initial_allowance=initial_allowance, model_version=model_version,
            completions=log_completions,
        )
        self.worker = RolloutWorker(loop_cls, loop_kwargs, self.channel)
        self.worker.start()

    def check_health(self) -> None:
        self.worker.check_health()

    def metrics(self) -> list[MetricRecord]:
        return drain(self.channel.metrics)

    def completions(self) -> list[dict[str, Any]]:
        """The sampled completions queued for the table (`log_completions`), else none."""
        queue = self.channel.extra.get("completions")
        return drain(queue) if queue is not None else []

    def publish(
        self, *, token_allowance: int | None = None, model_version: WeightVersion | None = None
    ) -> None:
        if token_allowance is not None:
            self.channel.token_allowance.value = token_allowance
        if model_version is not None:
            self.channel.model_version.value = model_version

    def stop(self) -> None:
        self.worker.stop()
        self.channel.close()
