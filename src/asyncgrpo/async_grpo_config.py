"""The reference's module path for the config: `from asyncgrpo.async_grpo_config import AsyncGRPOConfig`
(defined in `asyncgrpo.config`)."""

from asyncgrpo.config import AsyncGRPOConfig

__all__ = ["AsyncGRPOConfig"]
