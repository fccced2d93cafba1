"""Who holds the embedded server, and for how long: the trainer whose weight-transfer group is up, and
the lease that keeps its pause (or a half-finished weight update) from outliving it.

    trainer (train/server_link.py)                 server
    GET  /lease at start  ----------------------->  refused if another live trainer holds the server
    POST /init_weight_transfer_engine  ---------->  holder = the trainer's id (TRAINER_HEADER)
    POST /renew_lease every few seconds  -------->  the holder's lease and the pause's lease renewed
    POST /pause?mode=keep[&lease_s=N]  ---------->  paused until /resume or until the lease runs out
    (trainer killed)                                lease runs out: generation resumes, a half-finished
                                                    update is abandoned (warnings); a new trainer may init

vLLM's /pause has no lease: a pause that names none gets `--trainer-lease` seconds (0: no expiry, as
vLLM), and every weight-transfer call renews it, so a vLLM-shaped client that never renews still
works as long as it keeps syncing. Nothing expires while a weight-transfer call is in flight. A pause
the books never saw (its handler cancelled between pausing the engine and booking the lease, as when
its client has gone; or one that raced a resume) is booked by the watchdog when it finds the engine
paused (`book_pause`), so every pause ends with a lease, whatever happened to its request.
Plain bookkeeping on the event loop's thread; the watchdog that acts on it lives in `routes/lease.py`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from asyncgrpo.generation.protocol import TRAINER_HEADER

__all__ = ["TRAINER_HEADER", "Holder", "Leases"]


@dataclass
class Holder:
    trainer_id: str | None  # None: a client that sends no TRAINER_HEADER
    peer: str | None  # the client's address
    since: float  # monotonic seconds
    last_seen: float


class Leases:
    """The holder of the weight-transfer group and the pause deadline. `lease_s` 0 means no expiry."""

    def __init__(self, lease_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.lease_s = lease_s
        self.clock = clock
        self.holder: Holder | None = None
        self.pause_deadline: float | None = None
        self.pause_lease_s: float | None = None  # the booked pause's lease (0: no expiry); None: none booked
        self.busy = 0  # weight-transfer calls in flight

    # ---- pause ------------------------------------------------------------------------------------
    def paused(self, lease_s: float | None) -> None:
        self.pause_lease_s = self.lease_s if lease_s is None else lease_s
        self.pause_deadline = self.clock() + self.pause_lease_s if self.pause_lease_s > 0 else None

    def resumed(self) -> None:
        self.pause_deadline = None
        self.pause_lease_s = None

    def book_pause(self) -> None:
        """The engine is paused: if no pause is booked, book one with the server's lease from now."""
        if self.pause_lease_s is None:
            self.paused(None)

    def pause_expired(self) -> bool:
        return self.pause_deadline is not None and self.busy == 0 and self.clock() > self.pause_deadline

    # ---- holder -----------------------------------------------------------------------------------
    def hold(self, trainer_id: str | None, peer: str | None) -> None:
        now = self.clock()
        self.holder = Holder(trainer_id, peer, now, now)

    def release(self) -> None:
        self.holder = None

    def is_holder(self, trainer_id: str | None) -> bool:
        return self.holder is not None and self.holder.trainer_id == trainer_id

    def renew(self, trainer_id: str | None) -> bool:
        """A sign of life from `trainer_id`: renews the holder's lease if it is the holder, and the
        pause's lease if it is the holder or nobody holds the server. Returns whether it renewed."""
        if self.holder is not None and not self.is_holder(trainer_id):
            return False
        now = self.clock()
        if self.holder is not None:
            self.holder.last_seen = now
        if self.pause_deadline is not None:
            self.pause_deadline = now + self.pause_lease_s
        return True

    def holder_alive(self) -> bool:
        """Whether the holder renewed within the lease (always, without expiry or while a call runs)."""
        if self.holder is None:
            return False
        return self.lease_s <= 0 or self.busy > 0 or self.clock() - self.holder.last_seen <= self.lease_s

    def describe_holder(self) -> str:
        h = self.holder
        if h is None:
            return "nobody"
        now = self.clock()
        who = f"trainer {h.trainer_id}" if h.trainer_id else "a client without a trainer id"
        return (f"{who} from {h.peer or 'an unknown address'} (its group was set up "
                f"{now - h.since:.0f} s ago, last heard from {now - h.last_seen:.0f} s ago)")

    def seconds_left(self) -> float:
        """Until the holder's lease runs out without renewal."""
        if self.holder is None or self.lease_s <= 0:
            return 0.0
        return max(0.0, self.lease_s - (self.clock() - self.holder.last_seen))
