"""How many rollouts the server can take: the KV-cache cap (pure).

Two of the limits on starting more work live here (the staleness allowance is in
`asyncgrpo.rollout.admission`):

    1. server load            `ConcurrencyCap`, fed the server's KV-cache usage every poll:
                              starts at kv_cache_tokens // max_model_len, +25 % at most once per `cap`
                              finished rollouts while usage < 0.6 and nothing waits, -30 % when
                              usage > 0.8; without /metrics it is fixed at max_concurrent_rollouts
    2. resources              max_concurrent_rollouts, the user's upper bound for both

With several servers each has its own cap (`rollout.server_load.ServerLoad`), the limit on starting
a group is their sum (within max_concurrent_rollouts), and `choose_server` sends a new group to the one
with the most room.

Nothing here reads a clock or does I/O: the loop polls `/metrics` and calls these.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

RAISE_BELOW_USAGE = 0.6
CUT_ABOVE_USAGE = 0.8
RAISE_FACTOR = 1.25
CUT_FACTOR = 0.7


def initial_cap(kv_cache_tokens: int, max_model_len: int, max_concurrent_rollouts: int) -> int:
    """Requests that fit in the KV cache at full length, clipped to [1, max_concurrent_rollouts]."""
    if max_model_len <= 0:
        raise ValueError(f"max_model_len must be positive, got {max_model_len}")
    return min(max(kv_cache_tokens // max_model_len, 1), max_concurrent_rollouts)


class ConcurrencyCap:
    """Live cap on in-flight rollouts that follows the server's KV-cache usage.

    Feed it `on_rollout_finished()` as rollouts finish and `on_server_load(...)` at every `/metrics`
    poll; read `cap`. With `kv_cache_tokens=None` (no `/metrics`), the cap stays at
    `max_concurrent_rollouts`.

    Args:
        max_concurrent_rollouts: Upper bound of the cap (>= 1).
        kv_cache_tokens: The server's KV-cache capacity in tokens, or None without `/metrics`.
        max_model_len: The server's maximum sequence length (prompt + completion).
    """

    def __init__(self, max_concurrent_rollouts: int, kv_cache_tokens: int | None,
                 max_model_len: int | None) -> None:
        if max_concurrent_rollouts < 1:
            raise ValueError(f"max_concurrent_rollouts must be >= 1, got {max_concurrent_rollouts}")
        self.max_concurrent_rollouts = max_concurrent_rollouts
        self.adaptive = kv_cache_tokens is not None and max_model_len is not None
        if self.adaptive:
            self.cap = initial_cap(kv_cache_tokens, max_model_len, max_concurrent_rollouts)
        else:
            self.cap = max_concurrent_rollouts
        self.finished_since_change = 0

    def on_rollout_finished(self, count: int = 1) -> None:
        self.finished_since_change += count

    def on_server_load(self, kv_cache_usage: float, num_waiting: int) -> int:
        """Adjust the cap for one `/metrics` poll and return it.

        Args:
            kv_cache_usage: KV-cache usage in [0, 1] (the max over engines).
            num_waiting: Requests the server accepted but has not scheduled yet.
        """
        if not self.adaptive:
            return self.cap
        if kv_cache_usage > CUT_ABOVE_USAGE:
            new_cap = max(1, math.floor(self.cap * CUT_FACTOR))
        elif (
            kv_cache_usage < RAISE_BELOW_USAGE
            and num_waiting == 0
            and self.finished_since_change >= self.cap
        ):
            new_cap = min(self.max_concurrent_rollouts,
                          max(self.cap + 1, math.floor(self.cap * RAISE_FACTOR)))
        else:
            return self.cap
        if new_cap != self.cap:
            self.cap = new_cap
            self.finished_since_change = 0
        return self.cap


def choose_server(caps: Sequence[int], in_flight: Sequence[int]) -> int | None:
    """The index of the server a new group goes to: the most free capacity (its cap minus its rollouts in
    flight, which may be negative) among the servers whose cap is above 0; a tie goes to the lowest index.
    None when no server has a cap (every one is out).

    A group stays on its server (its prompt prefix is cached there once), so the choice is made when the
    group starts, against what each server holds then."""
    assert len(caps) == len(in_flight), "one cap and one in-flight count per server"
    best: int | None = None
    for i, (cap, busy) in enumerate(zip(caps, in_flight)):
        if cap > 0 and (best is None or cap - busy > caps[best] - in_flight[best]):
            best = i
    return best
