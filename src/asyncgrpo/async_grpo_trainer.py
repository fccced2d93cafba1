"""The reference's module path for the trainer:
`from asyncgrpo.async_grpo_trainer import AsyncGRPOTrainer` (defined in `asyncgrpo.train.trainer`)."""

from asyncgrpo.train.trainer import AsyncGRPOTrainer

__all__ = ["AsyncGRPOTrainer"]
