"""asyncgrpo: asynchronous GRPO training of language models.

Generation runs on an inference server (vLLM, or the embedded server of this package); a rollout
process streams and scores completions while the trainer consumes them, so generation and
gradient updates overlap.

    from asyncgrpo import AsyncGRPOTrainer, AsyncGRPOConfig, AsyncRolloutLoop, Rollout

The reference's submodule paths work too: `asyncgrpo.async_grpo_trainer`, `asyncgrpo.async_grpo_config`
and `asyncgrpo.async_rollout_worker` (TurnRecord, RolloutGroup, TrainingSequence), and TRL 1.18's stable
ones: `asyncgrpo.trainer.async_grpo_trainer`, `asyncgrpo.trainer.async_grpo_config` and
`asyncgrpo.generation.async_vllm_client` (AsyncVLLMClient). Agents that live in their own program train
with `HarnessAsyncGRPOTrainer` (docs/harness.md).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# Public names -> defining module. Imported on first use so that `import asyncgrpo` (and the
# spawned rollout process) stays light.
_PUBLIC = {
    "AsyncGRPOTrainer": "asyncgrpo.train.trainer",
    "AsyncGRPOConfig": "asyncgrpo.config",
    "AsyncRolloutLoop": "asyncgrpo.rollout.loop",
    "HarnessAsyncGRPOTrainer": "asyncgrpo.train.harness_trainer",
    "HarnessCommand": "asyncgrpo.rollout.harness",
    "HarnessRun": "asyncgrpo.rollout.harness",
    "Rollout": "asyncgrpo.types",
    "RolloutGroup": "asyncgrpo.types",
    "TrainingSequence": "asyncgrpo.types",
    "TurnRecord": "asyncgrpo.types",
}

__all__ = list(_PUBLIC)

if TYPE_CHECKING:
    from asyncgrpo.config import AsyncGRPOConfig as AsyncGRPOConfig
    from asyncgrpo.rollout.harness import HarnessCommand as HarnessCommand
    from asyncgrpo.rollout.harness import HarnessRun as HarnessRun
    from asyncgrpo.rollout.loop import AsyncRolloutLoop as AsyncRolloutLoop
    from asyncgrpo.train.harness_trainer import HarnessAsyncGRPOTrainer as HarnessAsyncGRPOTrainer
    from asyncgrpo.train.trainer import AsyncGRPOTrainer as AsyncGRPOTrainer
    from asyncgrpo.types import Rollout as Rollout
    from asyncgrpo.types import RolloutGroup as RolloutGroup
    from asyncgrpo.types import TrainingSequence as TrainingSequence
    from asyncgrpo.types import TurnRecord as TurnRecord


def __getattr__(name: str) -> Any:
    if name in _PUBLIC:
        import importlib

        return getattr(importlib.import_module(_PUBLIC[name]), name)
    raise AttributeError(f"module 'asyncgrpo' has no attribute {name!r}")
