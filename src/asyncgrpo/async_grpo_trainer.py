"""The reference's module path for the trainers:
`from asyncgrpo.async_grpo_trainer import AsyncGRPOTrainer` (defined in `asyncgrpo.train.trainer`) and
`HarnessAsyncGRPOTrainer` (defined in `asyncgrpo.train.harness_trainer`)."""

from asyncgrpo.train.harness_trainer import HarnessAsyncGRPOTrainer
from asyncgrpo.train.trainer import AsyncGRPOTrainer

__all__ = ["AsyncGRPOTrainer", "HarnessAsyncGRPOTrainer"]
