"""Counter tool task: bring a counter from 0 to a target by calling ``increment(step)``.

A row is ``{"prompt": [{"role": "user", "content": "Bring the counter to 13. Each increment can add
at most 5."}], "target": 13, "max_step": 5}``. The trainer passes the row's columns to
``IncrementEnv.reset(**row)``, exposes ``IncrementEnv.increment`` as a tool and scores the rollout
with ``IncrementEnv.get_reward()`` (1.0 when the counter ends exactly at the target).

``reference_messages`` gives the conversation the bundled tiny model was trained on: the largest
allowed step until the remainder fits, one call per turn, then ``"The counter is at 13."``.
Everything here except the environment's state is pure and seeded.
"""

from __future__ import annotations

import math
import random

__all__ = [
    "MAX_CALLS",
    "MAX_STEP_RANGE",
    "TARGET_RANGE",
    "IncrementEnv",
    "final_message",
    "make_dataset",
    "make_row",
    "reference_messages",
    "user_message",
]

TARGET_RANGE = (1, 30)
"""Inclusive range of targets."""
MAX_STEP_RANGE = (2, 9)
"""Inclusive range of the largest step one ``increment`` call may add."""
MAX_CALLS = 4
"""Tasks need at most this many calls with the largest step (well inside an 8-turn cap)."""


def user_message(target: int, max_step: int) -> str:
    """The user's request for one task."""
    return f"Bring the counter to {target}. Each increment can add at most {max_step}."


def final_message(target: int) -> str:
    """The reference closing answer once the counter reached ``target``."""
    return f"The counter is at {target}."


def make_row(target: int, max_step: int) -> dict:
    """Build one dataset row (prompt, target, max_step)."""
    if not 1 <= target or not 1 <= max_step:
        raise ValueError(f"target and max_step must be >= 1, got {target} and {max_step}")
    return {
        "prompt": [{"role": "user", "content": user_message(target, max_step)}],
        "target": target,
        "max_step": max_step,
    }


def _draw(rng: random.Random) -> tuple[int, int]:
    while True:
        target = rng.randint(*TARGET_RANGE)
        max_step = rng.randint(*MAX_STEP_RANGE)
        if math.ceil(target / max_step) <= MAX_CALLS:
            return target, max_step


def make_dataset(n: int, seed: int) -> list[dict]:
    """Return ``n`` tasks drawn with ``random.Random(seed)``.

    Targets come from ``TARGET_RANGE``, step limits from ``MAX_STEP_RANGE``, and a task never needs
    more than ``MAX_CALLS`` calls. The same seed gives the same rows.
    """
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    rng = random.Random(seed)
    return [make_row(*_draw(rng)) for _ in range(n)]


def reference_messages(target: int, max_step: int) -> list[dict]:
    """The assistant/tool messages that solve a task, in chat-template form.

    Each assistant turn holds one ``increment`` call with ``min(max_step, remaining)``; each tool
    message holds the new counter value; the last assistant turn states the result.
    """
    messages: list[dict] = []
    counter = 0
    while counter < target:
        step = min(max_step, target - counter)
        counter += step
        call = {"type": "function", "function": {"name": "increment", "arguments": {"step": step}}}
        messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        messages.append({"role": "tool", "name": "increment", "content": str(counter)})
    messages.append({"role": "assistant", "content": final_message(target)})
    return messages


class IncrementEnv:
    """A counter that the model raises to a target through the ``increment`` tool.

    Follows the environment protocol of the trainer: ``reset`` and ``get_reward`` are reserved, every
    other public method (here ``increment``) is a tool whose schema comes from its signature and
    Google docstring. Picklable; one instance serves many rollouts (``reset`` clears it).

    Args:
        seed: Seed of the generator used when ``reset`` gets no ``target`` (self-sampled tasks).
    """

    def __init__(self, seed: int | None = None) -> None:
        self._rng = random.Random(seed)
        self.counter = 0
        self.target: int | None = None
        self.max_step: int | None = None

    def reset(self, target: int | None = None, max_step: int | None = None, **kwargs) -> str | None:
        """Start an episode at counter 0.

        With ``target`` (a dataset row's columns), the row's prompt is used and None is returned.
        Without it, the environment draws a task itself and returns the user message.
        ``max_step=None`` allows any step.
        """
        self.counter = 0
        if target is None:
            self.target, self.max_step = _draw(self._rng)
            return user_message(self.target, self.max_step)
        self.target = int(target)
        self.max_step = None if max_step is None else int(max_step)
        return None

    def get_reward(self) -> float:
        """1.0 when the counter is exactly at the target, else 0.0."""
        return float(self.target is not None and self.counter == self.target)

    def increment(self, step: int) -> int:
        """
        Increment the internal counter.

        Args:
            step: Value to add to the counter.

        Returns:
            The updated counter value.
        """
        if isinstance(step, bool) or not isinstance(step, int):
            raise TypeError(f"step must be an integer, got {step!r}")
        if self.max_step is not None and not 1 <= step <= self.max_step:
            raise ValueError(f"step must be between 1 and {self.max_step}, got {step}")
        self.counter += step
        return self.counter
