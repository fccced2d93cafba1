"""Staleness of samples in weight versions, and the drop rule (pure).

A sample generated under model version v and taken by the trainer at version c is `c - v` weight
updates stale. It is dropped (counted in `sample/dropped_stale_count`) when that exceeds
`max_staleness`: a sample exactly `max_staleness` versions behind is still trained.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterable
from typing import TypeVar

T = TypeVar("T")


def staleness(model_version: int, current_version: int) -> int:
    """Weight updates between the policy that generated a sample and the one training it."""
    return current_version - model_version


def is_stale(model_version: int, current_version: int, max_staleness: int) -> bool:
    """Whether a sample generated at `model_version` is too old to train at `current_version`."""
    return staleness(model_version, current_version) > max_staleness


def oldest_fresh_version(current_version: int, max_staleness: int) -> int:
    """The oldest model version whose samples are still trained at `current_version`: a rollout started
    under an older one is dropped whatever it generates next (so it may be served by any newer policy)."""
    return current_version - max_staleness


def split_stale(
    samples: Iterable[T],
    current_version: int,
    max_staleness: int,
    version_of: Callable[[T], int] = operator.attrgetter("model_version"),
) -> tuple[list[T], list[T]]:
    """Split `samples` into (fresh, stale), each keeping the input order.

    `version_of` reads the version a sample was generated at (default: its `model_version`).
    """
    fresh: list[T] = []
    stale: list[T] = []
    for sample in samples:
        (stale if is_stale(version_of(sample), current_version, max_staleness) else fresh).append(sample)
    return fresh, stale
