"""Synthetic tasks the bundled tiny model was trained on; the RL demo and examples use them.

- ``arithmetic``: "What is 37 + 48?" answered with a short chain and ``\\boxed{85}``.
- ``counter``: reach a target with the ``increment(step)`` tool of ``counter.IncrementEnv``.

Each module offers ``make_dataset(n, seed)`` (pure, seeded, conversational ``prompt`` column) and a
checker (``arithmetic.is_correct``, ``counter.IncrementEnv.get_reward``).
"""

from asyncgrpo.tasks import arithmetic, counter

__all__ = ["arithmetic", "counter"]
