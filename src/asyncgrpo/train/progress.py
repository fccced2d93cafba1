"""Which prompts are trained: epoch accounting and the resume position.

Every prompt of the rollout stream has a position (epoch * len(dataset) + index in that epoch's
order). The rollout process sends its samples, then a `GroupFinished(position, num_samples)` marker.
A prompt is *done* once the marker arrived and that many of its samples were trained (or dropped as
stale or oversize). The trained position is the first position not yet done: the resume point,
never ahead of anything that was generated but not trained. A prompt with some samples trained and some
not (its group straddles two optimizer steps) is *partly trained*: a checkpoint keeps its untrained
samples, so that a resumed run trains them instead of generating the prompt again.
"""

from __future__ import annotations

import heapq


class TrainedPrompts:
    """Counts done prompts; pure bookkeeping, no I/O."""

    def __init__(self, start_position: int = 0) -> None:
        self._next_position = start_position  # every position below this is done
        self._remaining: dict[int, int] = {}  # position -> samples not yet trained (negative until marker)
        self._finished_markers: set[int] = set()
        self._consumed: dict[int, int] = {}  # position -> samples trained or dropped, until done
        self._done: list[int] = []  # heap of done positions >= _next_position
        self.num_done = 0

    @property
    def trained_position(self) -> int:
        """Index of the first prompt that is not fully trained yet."""
        return self._next_position

    @property
    def trained_above(self) -> tuple[int, ...]:
        """The done positions above `trained_position` (finished out of order), sorted."""
        return tuple(sorted(p for p in self._done if p > self._next_position))

    @property
    def partly_trained(self) -> frozenset[int]:
        """Positions not done with at least one sample trained or dropped already."""
        return frozenset(self._consumed)

    @property
    def awaiting_marker(self) -> frozenset[int]:
        """Partly trained positions whose marker has not come yet (more of their samples may follow)."""
        return frozenset(p for p in self._consumed if p not in self._finished_markers)

    def on_sample_consumed(self, position: int) -> None:
        """A sample of `position` was trained or dropped."""
        self._remaining[position] = self._remaining.get(position, 0) - 1
        self._consumed[position] = self._consumed.get(position, 0) + 1
        self._maybe_done(position)

    def on_group_finished(self, position: int, num_samples: int) -> None:
        """The marker for `position`: `num_samples` samples were queued for it."""
        self._remaining[position] = self._remaining.get(position, 0) + num_samples
        self._finished_markers.add(position)
        self._maybe_done(position)

    def _maybe_done(self, position: int) -> None:
        if position not in self._finished_markers or self._remaining.get(position, 0) > 0:
            return
        assert self._remaining[position] == 0, f"prompt {position}: more samples trained than queued"
        del self._remaining[position]
        self._consumed.pop(position, None)
        self._finished_markers.discard(position)
        self.num_done += 1
        heapq.heappush(self._done, position)
        while self._done and self._done[0] == self._next_position:
            heapq.heappop(self._done)
            self._next_position += 1
        while self._done and self._done[0] < self._next_position:
            heapq.heappop(self._done)
