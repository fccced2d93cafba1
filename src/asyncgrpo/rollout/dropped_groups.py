"""A rollout process whose every group is dropped says so, naming the cause and the fix.

A group is dropped when its rewards carry no signal (all scored rewards equal, or fewer than two
scored: every source returned None/NaN). A reward that is constant or NaN for everything therefore
gives the trainer nothing, forever, with the server busy; the trainer side only notices after its
queue wait. `DroppedGroupsWatch` counts consecutive dropped groups and returns a warning at
`warn_after` of them, then each time the count doubles (so a long run of them is not a flood).
"""

from __future__ import annotations

import numpy as np

DROPPED_GROUPS_WARN_AFTER = 32


class DroppedGroupsWatch:
    def __init__(self, warn_after: int = DROPPED_GROUPS_WARN_AFTER) -> None:
        self.warn_after = warn_after
        self.consecutive = 0
        self._unscored = 0  # of the consecutive dropped groups: fewer than two scored rewards
        self._last_value = float("nan")  # a reward shared by a whole group, the latest seen
        self._next_warning = warn_after

    def observe(self, rewards: np.ndarray, *, kept: bool) -> str | None:
        """Count one scored group (`rewards`: NaN = unscored); a warning message when one is due."""
        if kept:
            self.consecutive, self._unscored, self._next_warning = 0, 0, self.warn_after
            return None
        self.consecutive += 1
        scored = rewards[~np.isnan(rewards)]
        if scored.size < 2:
            self._unscored += 1
        else:
            self._last_value = float(scored[0])
        if self.consecutive < self._next_warning:
            return None
        self._next_warning *= 2
        return self._message()

    def _message(self) -> str:
        n, unscored = self.consecutive, self._unscored
        head = (f"the last {n} groups were all dropped, so no sample reaches the trainer and no step is "
                "taken: ")
        no_score = (
            "no reward source scored their rollouts (every reward was None or NaN); make the reward "
            "functions return a float for these prompts (None/NaN means 'not applicable')"
        )
        constant = (
            f"every rollout of a group got the same reward (the latest: {self._last_value:g}); check that "
            "the reward can tell completions apart, or use prompts the model solves sometimes but not always "
            "(see frac_reward_zero_std and reward_dropped)"
        )
        if unscored == n:
            return head + no_score
        if unscored == 0:
            return head + constant
        return head + (f"{unscored} had fewer than two scored rollouts: {no_score}; {n - unscored} had equal "
                       f"rewards: {constant}")
