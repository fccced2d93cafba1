"""The prompt stream: dataset validation, epoch order, resume position and the `filter_prompt` hook.

Every prompt the rollout process considers has a *position* in one endless stream:

    position = epoch * len(dataset) + index in that epoch's order

Each epoch visits every row once, in an order shuffled from (seed, epoch), so a position maps back to
the same row on resume: `iter_prompts(start_position=p)` continues exactly where position p was.
`filter_prompt(row_index, row, epoch)` may reject a prompt; a rejected prompt is still yielded (with
`accepted=False`) because it counts toward the epoch like a dropped group. An epoch in which every
prompt was rejected raises, since no sample could ever reach the trainer.

An `IterableDataset` cannot be indexed: it is read in its own order (`set_epoch(epoch)` is called so
a shuffled stream reshuffles), positions count rows read, and a resume restarts from its first row.
"""

from __future__ import annotations

import itertools
import logging
import math
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

logger = logging.getLogger(__name__)

PROMPT_COLUMN = "prompt"
ENVIRONMENT_COLUMN = "environment"  # names the environment of a row when environment_factory is a dict
RESERVED_COLUMNS = ("prompts", "completions", "completion_ids")

_CONVERT_HINT = (
    "dataset = dataset.map(lambda row: {'prompt': [{'role': 'user', 'content': row['prompt']}]})"
)

FilterPrompt = Callable[[int, dict[str, Any], int], bool]


@dataclass(frozen=True)
class PromptItem:
    """One prompt of the stream.

    Attributes:
        position: Index in the endless prompt stream (see the module docstring).
        epoch: Number of full passes over the dataset before this one.
        row_index: Index of the row in the dataset (for an IterableDataset: rows read in this pass).
        row: The dataset row.
        accepted: False when `filter_prompt` rejected the prompt for this epoch.
    """

    position: int
    epoch: int
    row_index: int
    row: dict[str, Any]
    accepted: bool = True


def is_iterable_dataset(dataset: Any) -> bool:
    """Whether `dataset` can only be iterated (no `len`/indexing), like `datasets.IterableDataset`."""
    return not (hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__"))


def check_prompt(prompt: Any, where: str = "prompt") -> None:
    """Raise `ValueError` unless `prompt` is a non-empty list of {"role", "content"} message dicts."""
    if isinstance(prompt, str):  # a wrong type, but reported like every other dataset problem
        raise ValueError(  # noqa: TRY004
            f"{where} is a plain string ({prompt[:40]!r}...); prompts must be conversational: a list of "
            f"{{'role', 'content'}} messages. Convert the dataset with: {_CONVERT_HINT}"
        )
    if not isinstance(prompt, (list, tuple)) or not prompt:
        raise ValueError(
            f"{where} is {type(prompt).__name__} {prompt!r:.60}; it must be a non-empty list of "
            f"{{'role', 'content'}} messages, e.g. [{{'role': 'user', 'content': 'What is 2+2?'}}]"
        )
    for i, message in enumerate(prompt):
        if not isinstance(message, Mapping) or "role" not in message or "content" not in message:
            raise ValueError(
                f"{where}[{i}] is {message!r:.80}; each message must be a dict with 'role' and 'content' keys"
            )
        media = _media_in(message["content"])
        if media is not None:
            raise ValueError(
                f"{where}[{i}] holds {media} content; images are not supported yet: prompts must be text "
                "only (vision-language checkpoints train their text model on text-only prompts). Keep the "
                f"text parts, e.g. {{'role': 'user', 'content': [{{'type': 'text', 'text': '...'}}]}}, or "
                "drop the rows with images"
            )


_MEDIA_PART_TYPES = ("image", "image_url", "input_image", "video", "video_url", "input_video")


def _media_in(content: Any) -> str | None:
    """What non-text a message's content holds ('image', 'video_url', ...), or None for text."""
    if isinstance(content, str) or content is None or not isinstance(content, (list, tuple)):
        return None
    for part in content:
        if isinstance(part, Mapping):
            kind = part.get("type")
            if kind in _MEDIA_PART_TYPES:
                return str(kind)
            keys = [key for key in _MEDIA_PART_TYPES if key in part]
            if keys:
                return keys[0]
        elif not isinstance(part, str):
            return f"non-text ({type(part).__name__})"
    return None


def _first_row(dataset: Any) -> dict[str, Any] | None:
    if is_iterable_dataset(dataset):
        return next(iter(dataset), None)
    return dataset[0] if len(dataset) else None


def _column_names(dataset: Any, first_row: Mapping[str, Any]) -> list[str]:
    names = getattr(dataset, "column_names", None)
    return list(names) if names else list(first_row)


def validate_prompt_dataset(
    dataset: Any,
    *,
    prompt_required: bool = True,
    environment: bool = False,
    environment_names: Collection[str] | None = None,
) -> None:
    """Check a training dataset up front; raise `ValueError` that says how to fix it.

    Args:
        dataset: A `datasets.Dataset`, `datasets.IterableDataset` or a list of row dicts.
        prompt_required: False when an environment's `reset()` provides the prompt (the column may
            then be missing, but if present it must still be conversational).
        environment: True when an `environment_factory` is given; same as `prompt_required=False`.
        environment_names: the keys of an `environment_factory` dict: every row's `environment`
            column must name one of them (a stream is checked on its first row only).
    """
    prompt_required = prompt_required and not environment
    first = _first_row(dataset)
    if first is None:
        raise ValueError("train_dataset is empty; give at least one row")
    columns = _column_names(dataset, first)
    if environment_names is not None:
        _check_environment_column(dataset, first, columns, set(environment_names))
    reserved = [c for c in RESERVED_COLUMNS if c in columns]
    if reserved:
        raise ValueError(
            f"train_dataset has column(s) {reserved}, which clash with the arguments every reward "
            f"function receives; rename them, e.g. dataset = dataset.rename_column({reserved[0]!r}, "
            f"'{reserved[0]}_ref')"
        )
    if PROMPT_COLUMN not in columns:
        if prompt_required:
            raise ValueError(
                f"train_dataset has no 'prompt' column (columns: {columns}); add one holding conversational "
                f"prompts, e.g. dataset = dataset.map(lambda row: {{'prompt': [{{'role': 'user', "
                f"'content': row[{columns[0]!r}]}}]}}), or pass an environment_factory whose reset() returns "
                f"the prompt"
            )
        return
    check_prompt(first[PROMPT_COLUMN], where="train_dataset[0]['prompt']")


def _check_environment_column(
    dataset: Any, first: Mapping[str, Any], columns: list[str], names: set[str]
) -> None:
    if ENVIRONMENT_COLUMN not in columns:
        raise ValueError(
            f"environment_factory is a dict of {len(names)} environments ({sorted(names)}), but "
            f"train_dataset has no {ENVIRONMENT_COLUMN!r} column to choose one per row; add it, holding one "
            "of those names in every row"
        )
    if isinstance(dataset, Sequence):
        values = [row.get(ENVIRONMENT_COLUMN) for row in dataset]
    elif hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__"):
        values = list(dataset[ENVIRONMENT_COLUMN])  # a datasets.Dataset: one column read
    else:
        values = [first.get(ENVIRONMENT_COLUMN)]  # a stream: only what is at hand
    unknown = sorted({repr(v) for v in values if v not in names})
    if unknown:
        index = next(i for i, v in enumerate(values) if v not in names)
        raise ValueError(
            f"train_dataset[{index}][{ENVIRONMENT_COLUMN!r}] = {values[index]!r} does not name an "
            f"environment (unknown values: {', '.join(unknown[:5])}); environment_factory has {sorted(names)}"
        )


def epoch_order(num_rows: int, seed: int, epoch: int, shuffle: bool = True) -> np.ndarray:
    """Row indices of one epoch: a permutation drawn from (seed, epoch), or 0..n-1 without shuffle."""
    if not shuffle:
        return np.arange(num_rows)
    if seed < 0:
        raise ValueError(f"the data seed must be non-negative to shuffle prompts, got {seed}")
    return np.random.default_rng([seed, epoch]).permutation(num_rows)


def end_position(max_steps: int, num_train_epochs: float, dataset: Any) -> int | None:
    """First position past the run when epochs stop it: ceil(num_train_epochs x rows). None when
    `max_steps` > 0 stops it instead, or the dataset is a stream (no length) or absent."""
    if max_steps > 0 or dataset is None:
        return None
    try:
        num_rows = len(dataset)
    except TypeError:
        return None
    return math.ceil(float(num_train_epochs) * num_rows)


def row_reward_kwargs(row: Mapping[str, Any], num_rollouts: int) -> dict[str, list[Any]]:
    """Every column of `row` but the prompt, repeated once per rollout (reward function kwargs)."""
    return {key: [value] * num_rollouts for key, value in row.items() if key != PROMPT_COLUMN}


def iter_prompts(
    dataset: Any,
    *,
    seed: int,
    start_position: int = 0,
    shuffle: bool = True,
    filter_prompt: FilterPrompt | None = None,
    max_epochs: int | None = None,
    prompt_required: bool = True,
    skip_positions: Collection[int] = (),
) -> Iterator[PromptItem]:
    """Yield the prompt stream from `start_position` on (endless unless `max_epochs` is given).

    Args:
        dataset: Map-style dataset (or list of rows), or an IterableDataset.
        seed: Seed of the per-epoch shuffle (the trainer passes `data_seed`, else `seed`).
        start_position: First position to yield (`rollout_state.json`'s trained position). Ignored,
            with a warning, for an IterableDataset, which restarts from its first row.
        shuffle: Shuffle each epoch (map-style datasets only).
        filter_prompt: `(row_index, row, epoch) -> bool`; False rejects the prompt for this epoch.
        max_epochs: Stop after this many epochs (counted from epoch 0).
        prompt_required: Check every row's prompt is conversational (see `validate_prompt_dataset`).
        skip_positions: Positions already trained (`rollout_state.json`'s `trained_above`): yielded as
            not accepted, without calling `filter_prompt`, so a resumed run trains each prompt once.

    Raises:
        ValueError: a row's prompt is malformed, the dataset is empty, or `filter_prompt` rejected
            every prompt of a whole epoch.
    """
    if start_position < 0:
        raise ValueError(f"start_position must be >= 0, got {start_position}")
    rows = _iter_rows(dataset, seed=seed, start_position=start_position, shuffle=shuffle,
                      max_epochs=max_epochs)
    epoch, accepted, seen, whole_epoch = -1, 0, 0, False
    for position, ep, row_index, row, epoch_start in rows:
        if position in skip_positions:
            yield PromptItem(position=position, epoch=ep, row_index=row_index, row=row, accepted=False)
            continue
        if ep != epoch:
            _check_epoch_not_all_rejected(epoch, seen, accepted, whole_epoch)
            epoch, accepted, seen, whole_epoch = ep, 0, 0, epoch_start
        if prompt_required or PROMPT_COLUMN in row:
            check_prompt(row.get(PROMPT_COLUMN), where=f"train_dataset[{row_index}]['prompt']")
        ok = True if filter_prompt is None else bool(filter_prompt(row_index, row, ep))
        accepted += ok
        seen += 1
        yield PromptItem(position=position, epoch=ep, row_index=row_index, row=row, accepted=ok)
    _check_epoch_not_all_rejected(epoch, seen, accepted, whole_epoch)


def prompt_stream(
    dataset: Any,
    *,
    seed: int,
    start_position: int,
    filter_prompt: Callable[[int, dict[str, Any], int], bool],
    prompt_required: bool,
    skip_positions: Collection[int],
) -> Iterator[PromptItem]:
    """`iter_prompts` over `dataset`; without a dataset (an environment's reset() makes the prompts), an
    endless stream of empty rows."""
    if dataset is not None:
        yield from iter_prompts(
            dataset, seed=seed, start_position=start_position, filter_prompt=filter_prompt,
            prompt_required=prompt_required, skip_positions=skip_positions,
        )
        return
    for position in itertools.count(start_position):
        skip = position in skip_positions
        yield PromptItem(position, 0, position, {}, not skip and bool(filter_prompt(position, {}, 0)))


def _check_epoch_not_all_rejected(epoch: int, seen: int, accepted: int, whole_epoch: bool) -> None:
    """Raise once a whole epoch went by without `filter_prompt` accepting a single prompt."""
    if whole_epoch and seen and not accepted:
        raise ValueError(
            f"filter_prompt rejected all {seen} prompts of epoch {epoch}, so no sample can reach the "
            f"trainer; make it accept at least one prompt per epoch"
        )


def _iter_rows(
    dataset: Any, *, seed: int, start_position: int, shuffle: bool, max_epochs: int | None
) -> Iterator[tuple[int, int, int, dict[str, Any], bool]]:
    """(position, epoch, row_index, row, epoch_started_at_first_row) in stream order."""
    if is_iterable_dataset(dataset):
        yield from _iter_stream(dataset, start_position=start_position, max_epochs=max_epochs)
        return
    n = len(dataset)
    if n == 0:
        raise ValueError("train_dataset is empty; give at least one row")
    epoch, offset = divmod(start_position, n)
    while max_epochs is None or epoch < max_epochs:
        order = epoch_order(n, seed, epoch, shuffle)
        for k in range(offset, n):
            row_index = int(order[k])
            yield epoch * n + k, epoch, row_index, dict(dataset[row_index]), offset == 0
        epoch, offset = epoch + 1, 0


def _iter_stream(
    dataset: Any, *, start_position: int, max_epochs: int | None
) -> Iterator[tuple[int, int, int, dict[str, Any], bool]]:
    if start_position:
        logger.warning(
            "train_dataset is an IterableDataset, which cannot be repositioned: the rollout process "
            "restarts from its first prompt instead of position %d",
            start_position,
        )
    position, epoch = 0, 0
    while max_epochs is None or epoch < max_epochs:
        if hasattr(dataset, "set_epoch"):
            dataset.set_epoch(epoch)
        row_index = -1
        for row_index, row in enumerate(dataset):
            yield position, epoch, row_index, dict(row), True
            position += 1
        if row_index < 0:
            raise ValueError("train_dataset is empty; give at least one row")
        epoch += 1
