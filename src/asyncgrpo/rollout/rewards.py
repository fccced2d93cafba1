"""Scoring a group: call every reward source and sum per rollout with None semantics.

    reward_funcs (sync: each in a thread; async: awaited)  --\
    environments' get_reward   (group.env_rewards)          --+--> per-source arrays --> totals
    Rollout.reward             (group.rollout_rewards)      --/

Reward functions are called concurrently, once per group, with the keyword arguments `prompts`,
`completions`, `completion_ids` and every other column of the prompt's dataset row (one value per
rollout). Each returns one float, or None ("not applicable"), per rollout. A rollout's total is the
sum of the values that are not None (NaN counts as None); a rollout that no source scored gets NaN,
which `compute_advantages` excludes from the group statistics. An infinite value is an error like a
raising function (`RewardFunctionError` naming the source and the value): standardised within the
group it would turn every advantage into NaN and, through the loss, every weight.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from asyncgrpo.data.prompts import PROMPT_COLUMN, RESERVED_COLUMNS
from asyncgrpo.types import RolloutGroup


class RewardFunctionError(RuntimeError):
    """A reward function raised; the original exception is chained as `__cause__`."""


@dataclass(frozen=True)
class GroupRewards:
    """Rewards of one group.

    Attributes:
        totals: Shape (num_rollouts,): sum over sources, NaN where no source scored the rollout.
        per_source: Source name -> shape (num_rollouts,) values, NaN where that source returned None.
            Keys: reward function names, then environment class names (for `get_reward`).
    """

    totals: np.ndarray
    per_source: dict[str, np.ndarray]


def callable_name(func: Callable[..., Any]) -> str:
    """The name of a reward function or tool (how it is logged, how the model calls a tool): its
    `__name__`, a partial's function's, or the class name of a callable instance."""
    while isinstance(func, functools.partial):
        func = func.func
    name = getattr(func, "__name__", None)
    return name if isinstance(name, str) else type(func).__name__


def reward_func_names(funcs: Sequence[Callable[..., Any]]) -> list[str]:
    """Unique names for `funcs`; a repeated name gets a `_1`, `_2`, ... suffix in order."""
    names: list[str] = []
    seen: dict[str, int] = {}
    for func in funcs:
        base = callable_name(func)
        count = seen.get(base, 0)
        seen[base] = count + 1
        names.append(base if count == 0 else f"{base}_{count}")
    return names


def check_reward_signatures(funcs: Sequence[Callable[..., Any]], columns: Sequence[str] | None) -> None:
    """Every reward function takes the keywords each call passes (`prompts`, `completions`,
    `completion_ids` and every dataset column but the prompt: `columns`, None when the dataset does not
    say) and needs none that no call passes; a `TypeError` naming the function and the fix otherwise,
    at construction instead of at the first group's scoring."""
    passed = [*RESERVED_COLUMNS, *(c for c in columns or () if c != PROMPT_COLUMN)]
    fix = ("reward functions are called with prompts, completions, completion_ids and every dataset column "
           "but the prompt as keywords: end the signature with **kwargs")
    for func, name in zip(funcs, reward_func_names(funcs), strict=True):
        try:
            params = list(inspect.signature(func).parameters.values())
        except (TypeError, ValueError):  # builtins and some C callables have none to read
            continue
        takes = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
        if not any(p.kind is p.VAR_KEYWORD for p in params):
            missing = [k for k in passed if k not in takes]
            if missing:
                raise TypeError(f"reward function {name!r} does not take the keyword(s) {missing}; {fix}")
        if columns is not None:
            unmet = [p.name for p in params if p.default is p.empty and p.name not in passed
                     and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY, p.POSITIONAL_ONLY)]
            if unmet:
                raise TypeError(
                    f"reward function {name!r} requires {unmet}, which no call passes: it gets prompts, "
                    "completions, completion_ids and the dataset's columns "
                    f"{sorted(set(passed) - set(RESERVED_COLUMNS))}; add the column to the dataset or give "
                    "the parameter a default"
                )


def _is_async(func: Callable[..., Any]) -> bool:
    return inspect.iscoroutinefunction(func) or inspect.iscoroutinefunction(type(func).__call__)


def _to_array(values: Any, name: str, n: int) -> np.ndarray:
    """Validate one function's return value and convert it; None -> NaN."""
    if isinstance(values, (str, bytes, Mapping)) or not (hasattr(values, "__len__")
                                                         and hasattr(values, "__iter__")):
        raise TypeError(
            f"reward function {name!r} returned {type(values).__name__}; it must return a list with one "
            f"float (or None) per completion"
        )
    if len(values) != n:
        raise ValueError(
            f"reward function {name!r} returned {len(values)} values for {n} completions; it must return "
            f"one float (or None) per completion, in order"
        )
    out = np.full(n, np.nan, dtype=np.float64)
    for i, value in enumerate(values):
        if value is None:
            continue
        if isinstance(value, (str, bytes)):
            raise _bad_value(name, i, value)
        try:
            out[i] = float(value)
        except (TypeError, ValueError):
            raise _bad_value(name, i, value) from None
    return out


def _bad_value(name: str, index: int, value: Any) -> TypeError:
    return TypeError(
        f"reward function {name!r} returned {value!r} ({type(value).__name__}) for completion {index}; "
        f"each value must be a float, or None when the reward does not apply"
    )


async def _call_one(func: Callable[..., Any], name: str, kwargs: dict[str, Any]) -> Any:
    try:
        if _is_async(func):
            return await func(**kwargs)
        result = await asyncio.to_thread(func, **kwargs)
        if inspect.isawaitable(result):
            result = await result
        return result
    except Exception as exc:
        hint = ""
        if isinstance(exc, TypeError) and "keyword argument" in str(exc):  # a row's column it does not take
            hint = ("; reward functions are called with every dataset column as a keyword: end the signature "
                    "with **kwargs")
        raise RewardFunctionError(
            f"reward function {name!r} raised {type(exc).__name__}: {exc}{hint}"
        ) from exc


async def call_reward_funcs(
    funcs: Sequence[Callable[..., Any]],
    names: Sequence[str],
    *,
    prompts: list[Any],
    completions: list[Any],
    completion_ids: list[list[int]],
    reward_kwargs: Mapping[str, list[Any]],
) -> dict[str, np.ndarray]:
    """Call every reward function concurrently; return name -> values (NaN for None), shape (n,)."""
    n = len(completions)
    clash = [key for key in RESERVED_COLUMNS if key in reward_kwargs]
    if clash:
        raise ValueError(
            f"dataset column(s) {clash} clash with the arguments every reward function receives "
            f"({', '.join(RESERVED_COLUMNS)}); rename them, e.g. dataset.rename_column({clash[0]!r}, ...)"
        )
    kwargs = dict(reward_kwargs, prompts=prompts, completions=completions, completion_ids=completion_ids)
    results = await asyncio.gather(*(_call_one(f, name, kwargs)
                                     for f, name in zip(funcs, names, strict=True)))
    return {name: _to_array(values, name, n) for name, values in zip(names, results, strict=True)}


def sum_rewards(sources: Sequence[np.ndarray], n: int) -> np.ndarray:
    """Per-rollout sum over sources ignoring NaN; NaN where every source is NaN. Shape (n,)."""
    if not sources:
        return np.full(n, np.nan)
    stacked = np.stack([np.asarray(s, dtype=np.float64) for s in sources])
    scored = ~np.isnan(stacked)
    totals = np.where(scored, stacked, 0.0).sum(axis=0)
    totals[~scored.any(axis=0)] = np.nan
    return totals


def _optional_values(values: Sequence[float | None]) -> np.ndarray:
    return np.array([math.nan if v is None else float(v) for v in values], dtype=np.float64)


def check_finite_rewards(values: np.ndarray, source: str) -> None:
    """Raise `RewardFunctionError` when `source` gave an infinite reward (NaN means "not applicable")."""
    bad = np.flatnonzero(np.isinf(values))
    if bad.size:
        i = int(bad[0])
        raise RewardFunctionError(
            f"{source} returned {values[i]} for completion {i} of its group ({bad.size} infinite value(s) in "
            "the group): rewards must be finite floats, or None (or NaN) when the reward does not apply; an "
            "infinite reward would make every advantage of the group NaN. Clip the reward or return None"
        )


async def score_group(
    group: RolloutGroup,
    reward_funcs: Sequence[Callable[..., Any]],
    names: Sequence[str] | None = None,
) -> GroupRewards:
    """Score every rollout of `group` with all reward sources (the group is not modified).

    Args:
        group: The group; its `env_rewards` and `rollout_rewards` are sources too.
        reward_funcs: The trainer's reward functions.
        names: Their names (default: `reward_func_names(reward_funcs)`).
    """
    n = len(group.completions)
    names = list(names) if names is not None else reward_func_names(reward_funcs)
    per_source = await call_reward_funcs(
        reward_funcs,
        names,
        prompts=group.prompts,
        completions=group.completions,
        completion_ids=group.completions_ids,
        reward_kwargs=group.reward_kwargs,
    )
    for i, entry in enumerate(group.env_rewards):
        if entry is None:
            continue
        env_cls, value = entry
        key = env_cls.__name__ if isinstance(env_cls, type) else str(env_cls)
        if key in names:
            key = f"{key}_env"
        per_source.setdefault(key, np.full(n, np.nan))[i] = math.nan if value is None else float(value)
    rollout_rewards = _optional_values(group.rollout_rewards)
    for name, values in per_source.items():
        check_finite_rewards(values, f"reward function {name!r}" if name in names else f"{name}.get_reward")
    check_finite_rewards(rollout_rewards, "Rollout.reward (set by generate_one)")
    sources = [*per_source.values(), rollout_rewards]
    return GroupRewards(totals=sum_rewards(sources, n), per_source=per_source)
