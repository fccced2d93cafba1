"""The reference's module path for the trainer:
`from asyncgrpo.async_grpo_trainer import AsyncGRPOTrainer` (defined in `asyncgrpo.train.trainer`), with
the environment protocol under the reference's name, `_SupportsReset` (`asyncgrpo.rollout.generate`)."""

from asyncgrpo.rollout.generate import EnvironmentFactory, SupportsReset
from asyncgrpo.train.trainer import AsyncGRPOTrainer

_SupportsReset = SupportsReset  # the reference's name for the environment protocol

__all__ = ["AsyncGRPOTrainer", "EnvironmentFactory"]
