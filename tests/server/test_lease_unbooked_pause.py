"""A pause the lease bookkeeping never saw (its request was cancelled half way when the client went, or
it raced a resume) still ends when a lease does: the watchdog books it when it finds the engine paused."""

from __future__ import annotations

from asyncgrpo.server.lease import Leases


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_an_unbooked_pause_gets_the_servers_lease_from_when_it_is_found():
    clock = Clock()
    leases = Leases(30.0, clock)
    leases.paused(None)
    leases.resumed()  # the books say resumed; the engine then took a pause whose handler never finished
    leases.book_pause()
    clock.now += 29
    assert not leases.pause_expired()
    clock.now += 2
    assert leases.pause_expired()


def test_a_booked_pause_keeps_its_own_lease():
    clock = Clock()
    leases = Leases(30.0, clock)
    leases.paused(5.0)
    clock.now += 4
    leases.book_pause()  # already on the books: the deadline does not move
    clock.now += 2
    assert leases.pause_expired()


def test_a_pause_without_expiry_stays_without():
    clock = Clock()
    leases = Leases(30.0, clock)
    leases.paused(0.0)  # vLLM's pause, asked for explicitly
    leases.book_pause()
    clock.now += 10_000
    assert not leases.pause_expired()
