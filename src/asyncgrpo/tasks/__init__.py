"""Synthetic tasks for the RL demo and examples; the bundled tiny model was trained on the first two.

- ``arithmetic``: "What is 37 + 48?" answered with a short chain and ``\\boxed{85}``.
- ``counter``: reach a target with the ``increment(step)`` tool of ``counter.IncrementEnv``.
- ``word_problems``: grade-school word problems of 2-3 steps (GSM8K-shaped, sized for small hub
  models), answered like ``arithmetic``; ``word_problems.to_gsm8k`` exports a row in GSM8K's format.

Each module offers ``make_dataset(n, seed)`` (pure, seeded, conversational ``prompt`` column) and a
checker (``arithmetic.is_correct``, ``counter.IncrementEnv.get_reward``, ``word_problems.is_correct``).
"""

from asyncgrpo.tasks import arithmetic, counter, word_problems

__all__ = ["arithmetic", "counter", "word_problems"]
