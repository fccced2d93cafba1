"""The trainer's arguments, checked before anything starts: each error names what to pass instead.

Run by `AsyncGRPOTrainer.__init__` (every rank); nothing here loads a model or talks to a server.
"""

from __future__ import annotations

import functools
import multiprocessing as mp
from collections.abc import Callable, Mapping
from typing import Any

import torch

from asyncgrpo.config import AsyncGRPOConfig
from asyncgrpo.data.prompts import validate_prompt_dataset
from asyncgrpo.rollout.channel import ROLLOUT_PROCESS_NAME
from asyncgrpo.rollout.rewards import check_reward_signatures


def check_not_in_rollout_process() -> None:
    if mp.current_process().name == ROLLOUT_PROCESS_NAME:
        raise RuntimeError(
            "AsyncGRPOTrainer was constructed inside the rollout process: the training script runs "
            "training when it is imported. The rollout process is spawned and imports the script to "
            "find the reward functions, tools or loop class defined there; put the training code "
            "under `if __name__ == \"__main__\":`"
        )


def check_args(args: AsyncGRPOConfig | None) -> AsyncGRPOConfig:
    """`args`, or the default config when None."""
    if args is None:
        return AsyncGRPOConfig(output_dir="asyncgrpo-output")
    if not isinstance(args, AsyncGRPOConfig):
        raise TypeError(f"`args` must be an AsyncGRPOConfig, got {type(args).__name__}")
    return args


def reward_func_list(reward_funcs: Callable | list[Callable] | None) -> list[Callable]:
    """The reward functions as a list; each must be callable."""
    if reward_funcs is None:
        reward_funcs = []
    funcs = list(reward_funcs) if isinstance(reward_funcs, (list, tuple)) else [reward_funcs]
    for i, fn in enumerate(funcs):
        # a model is callable, but not with rewards' keywords
        if not callable(fn) or isinstance(fn, torch.nn.Module):
            raise TypeError(
                f"reward_funcs[{i}] is a {type(fn).__name__}, not a reward function; reward models given as "
                "ids or PreTrainedModels are not supported: wrap the model behind a picklable reward function"
            )
    return funcs


def check_prompt_source(
    reward_funcs: list[Callable],
    train_dataset: Any,
    environment_factory: Callable | dict[str, Callable] | None,
    max_steps: int,
    rollout_reward: bool = False,
) -> None:
    """A reward source and a prompt source: a dataset, or a single environment whose reset() makes them.
    `rollout_reward`: the loop's rollouts carry a reward of their own (`Rollout.reward`)."""
    if not reward_funcs and environment_factory is None and not rollout_reward:
        raise ValueError("no reward source: pass `reward_funcs`, or an `environment_factory` whose class "
                         "defines get_reward")
    if not reward_funcs and not rollout_reward and environment_factory is not None:
        check_environments_score(environment_factory)  # a loop whose rollouts carry a reward scores them
    if train_dataset is None:
        if environment_factory is None or isinstance(environment_factory, dict):
            raise ValueError(
                "`train_dataset` is required unless a single `environment_factory` provides the prompts "
                "from reset()"
            )
        if max_steps <= 0:
            raise ValueError("without a `train_dataset`, set `max_steps` in AsyncGRPOConfig: there is no "
                             "epoch to count")
        check_reward_signatures(reward_funcs, [])  # no row: prompts, completions, completion_ids only
        return
    check_reward_signatures(reward_funcs, getattr(train_dataset, "column_names", None))
    validate_prompt_dataset(
        train_dataset,
        environment=environment_factory is not None,
        environment_names=list(environment_factory) if isinstance(environment_factory, dict) else None,
    )


def environment_class(factory: Callable) -> type:
    """The class of the environments `factory` makes: a class or a `functools.partial` of one is read as it
    is; any other callable is called once here (as the rollout process does for each rollout)."""
    target = factory
    while isinstance(target, functools.partial):
        target = target.func
    if isinstance(target, type):
        return target
    return type(factory())


def check_environments_score(environment_factory: Callable | dict[str, Callable]) -> None:
    """Without reward functions, every environment must score its rollouts with get_reward(): otherwise
    each rollout's reward is NaN, every group is dropped and nothing ever trains."""
    factories = (
        environment_factory if isinstance(environment_factory, Mapping) else {None: environment_factory}
    )
    for name, factory in factories.items():
        cls = environment_class(factory)
        scores = callable(getattr(cls, "get_reward", None))
        if not scores:
            where = "environment_factory" if name is None else f"environment_factory[{name!r}]"
            raise ValueError(
                f"no reward source: {where} makes {cls.__name__} environments, which define no get_reward(), "
                "and no reward_funcs were given, so no rollout could be scored. Define "
                f"`{cls.__name__}.get_reward(self) -> float`, or pass `reward_funcs`"
            )


def check_fsdp_version(fsdp_plugin: Any) -> None:
    if fsdp_plugin is not None and fsdp_plugin.fsdp_version != 2:
        raise ValueError(
            "FSDP version 1 is not supported: weight sync gathers FSDP2's DTensor parameters; set "
            "fsdp_config={'fsdp_version': 2} (or `accelerate launch --fsdp_version 2`)"
        )
