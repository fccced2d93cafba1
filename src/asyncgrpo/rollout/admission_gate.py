"""The dispatcher's gate: wait until `Admission` lets a group start, and tell the trainer when only it can.

    dispatcher --admit(n)--> Admission.blocker(n, trainer view, cap) --None--> the group starts
                                  | blocked
                                  |- no group open: RolloutIdle(reason, view) on channel.samples
                                  '- wait for progress (or POLL_S), read the trainer's view again
    dispatcher --end_of_prompts()--> every open group queued --> RolloutIdle(IDLE_OUT_OF_PROMPTS)

When the dispatcher is blocked with no group in flight or being scored, only the trainer can unblock
it: it puts a `RolloutIdle` on channel.samples (once per trainer view it is blocked against, and once
at the end of the prompts) so the trainer closes its partial micro-batch at once instead of waiting.

The gate wakes when a rollout or group of this process finishes (`on_progress`) and polls the values
the trainer writes (shared memory, no notification) every POLL_S. The rule it waits on is pure and
lives in `asyncgrpo.rollout.admission`; this module only waits, announces and times the waits.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from asyncgrpo import metrics as M
from asyncgrpo.rollout.admission import Admission
from asyncgrpo.rollout.channel import (
    IDLE_ON_POLICY,
    IDLE_OUT_OF_PROMPTS,
    IDLE_STALENESS,
    RolloutChannel,
    RolloutIdle,
)
from asyncgrpo.rollout.tasks import POLL_S


class AdmissionGate:
    """Where the dispatcher waits for a group to be admitted (create it inside the running event loop).

    Args:
        admission: The admission counters and rule the gate asks.
        channel: The trainer's view is read from it; `RolloutIdle` items go on its `samples`.
        cap: The current concurrency cap (KV cap within max_concurrent_rollouts).
        record: Where (name, value) metrics go.
    """

    def __init__(
        self,
        *,
        admission: Admission,
        channel: RolloutChannel,
        cap: Callable[[], int],
        record: Callable[[str, float], None],
    ) -> None:
        self.admission = admission
        self.channel = channel
        self.cap = cap
        self.record = record
        self._idle_sent: RolloutIdle | None = None  # the RolloutIdle sent since the last group started
        self._progressed = asyncio.Event()  # set when a rollout or group finishes (the gate wakes)

    def on_progress(self) -> None:
        """A rollout or group of this process finished: look at the admission rule again now."""
        self._progressed.set()

    async def admit(self, num_rollouts: int) -> None:
        """Wait until a group may start; time spent on the staleness limit is `rollout/backpressure_s`.

        Blocked with no group open, the loop has nothing more coming until the trainer moves: it says
        so with a `RolloutIdle` carrying the trainer values it is blocked against (again whenever they
        change and it is still blocked).
        """
        backpressure_s = 0.0
        while True:
            view = self.channel.trainer_view()  # one consistent read: the idle item names what it saw
            blocker = self.admission.blocker(num_rollouts, view, self.cap())
            if blocker is None:
                break
            if self.admission.groups_open == 0:
                assert blocker in (IDLE_STALENESS, IDLE_ON_POLICY), (
                    f"blocked on {blocker!r} with no group open")
                self._announce_idle(RolloutIdle(blocker, view))
            start = time.perf_counter()
            await self._wait_for_progress(POLL_S)
            if blocker in (IDLE_STALENESS, IDLE_ON_POLICY):
                backpressure_s += time.perf_counter() - start
        self._idle_sent = None
        if backpressure_s > 0:
            self.record(M.ROLLOUT_BACKPRESSURE_S, backpressure_s)

    async def end_of_prompts(self) -> None:
        """After the last dispatch: once every open group is on the queue, tell the trainer nothing more
        comes."""
        while self.admission.groups_open:
            await self._wait_for_progress(None)
        self.channel.samples.put(RolloutIdle(IDLE_OUT_OF_PROMPTS, None))

    def _announce_idle(self, item: RolloutIdle) -> None:
        if item != self._idle_sent:
            self.channel.samples.put(item)
            self._idle_sent = item

    async def _wait_for_progress(self, timeout_s: float | None) -> None:
        """Until a rollout or group of this process finishes, or `timeout_s` passed (None: no limit)."""
        try:
            await asyncio.wait_for(self._progressed.wait(), timeout_s)
        except asyncio.TimeoutError:
            pass
        self._progressed.clear()
