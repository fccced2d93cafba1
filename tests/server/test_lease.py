"""The trainer lease's bookkeeping (`asyncgrpo.server.lease`) on a hand-driven clock."""

from __future__ import annotations

from asyncgrpo.server.lease import Leases


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_pause_expires_unless_renewed_and_never_while_a_weight_call_runs():
    clock = Clock()
    leases = Leases(30.0, clock)
    leases.paused(None)  # vLLM's /pause: the server's lease
    clock.now += 29
    assert not leases.pause_expired()
    assert leases.renew(None)  # nobody holds the server: anyone's renewal counts
    clock.now += 29
    assert not leases.pause_expired()
    leases.busy = 1
    clock.now += 100
    assert not leases.pause_expired()
    leases.busy = 0
    assert leases.pause_expired()
    leases.resumed()
    assert not leases.pause_expired()


def test_lease_zero_or_explicit_lengths():
    clock = Clock()
    leases = Leases(30.0, clock)
    leases.paused(0.0)
    clock.now += 10_000
    assert not leases.pause_expired()
    leases.paused(5.0)
    clock.now += 6
    assert leases.pause_expired()
    forever = Leases(0.0, clock)
    forever.paused(None)
    forever.hold("a", "127.0.0.1")
    clock.now += 10_000
    assert not forever.pause_expired() and forever.holder_alive()


def test_only_the_holder_renews_its_hold_and_it_runs_out_without_renewals():
    clock = Clock()
    leases = Leases(10.0, clock)
    leases.hold("a", "10.0.0.1")
    leases.paused(None)
    clock.now += 8
    assert not leases.renew("b") and leases.renew("a")
    clock.now += 8
    assert leases.holder_alive() and not leases.pause_expired()
    assert "trainer a from 10.0.0.1" in leases.describe_holder() and leases.seconds_left() == 2.0
    clock.now += 3
    assert not leases.holder_alive() and leases.pause_expired() and leases.seconds_left() == 0.0
    leases.release()
    assert leases.holder is None and leases.describe_holder() == "nobody"
