"""The reference's module path for the trainers:
`from asyncgrpo.async_grpo_trainer import AsyncGRPOTrainer` (defined in `asyncgrpo.train.trainer`) and
`HarnessAsyncGRPOTrainer` (defined in `asyncgrpo.train.harness_trainer`), with the environment protocol
under the reference's name, `_SupportsReset` (`asyncgrpo.rollout.generate`)."""

from asyncgrpo.rollout.generate import EnvironmentFactory, SupportsReset
from asyncgrpo.train.harness_trainer import HarnessAsyncGRPOTrainer
from asyncgrpo.train.trainer import AsyncGRPOTrainer

_SupportsReset = SupportsReset  # the reference's name for the environment protocol

__all__ = ["AsyncGRPOTrainer", "EnvironmentFactory", "HarnessAsyncGRPOTrainer"]
