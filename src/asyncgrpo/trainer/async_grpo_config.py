"""TRL 1.18's `trl.trainer.async_grpo_config`: `AsyncGRPOConfig`, defined in `asyncgrpo.config`."""

from asyncgrpo.config import AsyncGRPOConfig

__all__ = ["AsyncGRPOConfig"]
