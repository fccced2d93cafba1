"""Checkpoints appear whole or not at all; resuming never picks a half-written one.

    <output_dir>/.checkpoint-staging/checkpoint-N   everything is written here (the Trainer's files,
                                                    then rollout_state.json) ...
    <output_dir>/checkpoint-N                       ... and renamed here when complete (one rename on
                                                    the same filesystem: atomic)

A run that dies mid-save leaves only the staging folder, which `get_last_checkpoint` does not match
and the next save clears. A checkpoint folder that lacks the files written last (`trainer_state.json`,
`rollout_state.json`: from a crash of an older version, or a copy cut short) is incomplete:
`resume_from_checkpoint=True` skips it with a warning, an explicit path to it is an error.

A full disk surfaces from torch or safetensors as an opaque serialisation error; `is_out_of_space`
recognises it, and the save raises `CheckpointDiskFullError` ("no space left on device while writing
checkpoint to PATH") after removing the partial copy.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from asyncgrpo.checkpoint import ROLLOUT_STATE_FILE, RolloutState, write_rollout_pending, write_rollout_state

logger = logging.getLogger(__name__)

STAGING_DIR = ".checkpoint-staging"
TRAINER_STATE_FILE = "trainer_state.json"  # transformers writes it after the model and optimizer
COMPLETE_MARKERS = (TRAINER_STATE_FILE, ROLLOUT_STATE_FILE)
_CHECKPOINT_RE = re.compile(r"^checkpoint-(\d+)$")
# how torch / safetensors word a failed write when the disk is full
_OUT_OF_SPACE_TEXT = ("no space left on device", "storagefull", "os error 28", "errno 28")
_WRITE_FAILED_TEXT = ("file write failed", "unexpected pos")
_LOW_FREE_BYTES = 64 * 2**20


class CheckpointDiskFullError(OSError):
    """The disk filled up while a checkpoint was written; the partial copy was removed."""


def missing_files(checkpoint: str | os.PathLike) -> list[str]:
    """The files written last that `checkpoint` lacks (empty: it is complete)."""
    return [name for name in COMPLETE_MARKERS if not (Path(checkpoint) / name).is_file()]


def last_complete_checkpoint(output_dir: str | os.PathLike) -> Path | None:
    """The highest-step complete `checkpoint-N` of `output_dir`, warning about each incomplete one
    above it; None when there is none."""
    root = Path(output_dir)
    if not root.is_dir():
        return None
    found = sorted(
        ((int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := _CHECKPOINT_RE.match(p.name))),
        reverse=True,
    )
    for _, path in found:
        missing = missing_files(path)
        if not missing:
            return path
        logger.warning(
            "skipping the incomplete checkpoint %s (no %s: it was being written when a run stopped); "
            "resuming from an earlier one. Delete it to silence this warning", path, " or ".join(missing),
        )
    return None


def resolve_resume_checkpoint(resume_from_checkpoint: str | bool, output_dir: str | os.PathLike) -> str:
    """The checkpoint folder to resume from: the latest complete one for True, else the given path,
    which must be complete."""
    if resume_from_checkpoint is True:
        path = last_complete_checkpoint(output_dir)
        if path is None:
            raise ValueError(
                f"resume_from_checkpoint=True but {output_dir} holds no complete checkpoint; start without "
                "resume_from_checkpoint or pass the path of one"
            )
        return str(path)
    path = Path(resume_from_checkpoint)
    if not path.is_dir():
        raise ValueError(
            f"resume_from_checkpoint={str(path)!r} is not a directory; pass a checkpoint-N folder")
    missing = missing_files(path)
    if missing:
        raise ValueError(
            f"the checkpoint {path} is incomplete (no {' or '.join(missing)}: it was being written when a "
            "run stopped); pass an earlier checkpoint, or resume_from_checkpoint=True to take the latest "
            "complete one"
        )
    return str(path)


def is_out_of_space(exc: BaseException, path: str | os.PathLike) -> bool:
    """Whether `exc` (or an exception it chains) means the disk holding `path` is full."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, OSError) and current.errno == errno.ENOSPC:
            return True
        text = str(current).lower()
        if any(marker in text for marker in _OUT_OF_SPACE_TEXT):
            return True
        if any(marker in text for marker in _WRITE_FAILED_TEXT) and _free_bytes(path) < _LOW_FREE_BYTES:
            return True  # torch's zip writer does not say why a write failed: ask the disk
        current = current.__cause__ or current.__context__
    return False


def _free_bytes(path: str | os.PathLike) -> int:
    probe = Path(path)
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    try:
        return shutil.disk_usage(probe).free
    except OSError:
        return 2**62


@contextmanager
def staged_checkpoint(
    run_dir: str | os.PathLike, folder: str, *, is_main: bool, barrier: Callable[[], None]
) -> Iterator[Path]:
    """Yield the run folder to write `folder` into (the staging one); on success rename
    `<staging>/<folder>` to `<run_dir>/<folder>`. Every process enters with the same arguments;
    `is_main` clears the staging area and renames, `barrier` keeps the others in step."""
    run_dir = Path(run_dir)
    staging_run = run_dir / STAGING_DIR
    staged = staging_run / folder
    final = run_dir / folder
    if is_main:
        shutil.rmtree(staging_run, ignore_errors=True)  # what a run that died mid-save left
        staging_run.mkdir(parents=True, exist_ok=True)
    barrier()
    try:
        yield staging_run
        barrier()
        if is_main:
            if final.exists():  # the same step saved again: the new copy replaces it
                shutil.rmtree(final)
            os.replace(staged, final)
            shutil.rmtree(staging_run, ignore_errors=True)
        barrier()
    except BaseException as exc:
        if is_main:
            shutil.rmtree(staging_run, ignore_errors=True)
        if is_out_of_space(exc, staging_run):
            raise CheckpointDiskFullError(
                errno.ENOSPC,
                f"no space left on device while writing checkpoint to {final} "
                f"({_free_bytes(run_dir) / 2**20:.0f} MiB free there): free some space or point output_dir "
                "at a larger disk, and keep fewer checkpoints with save_total_limit; the partial checkpoint "
                "was removed, earlier ones are intact",
            ) from exc
        raise


class StagedCheckpoints:
    """The Trainer's checkpoints written through `staged_checkpoint`, with `rollout_state.json` beside its
    files (a mixin before `transformers.Trainer`; the trainer says what the state is: `_rollout_state`)."""

    _checkpoint_staging: Path | None = None  # set while a checkpoint is written: the Trainer writes there

    def _rollout_state(self) -> RolloutState | None:
        raise NotImplementedError

    def _rollout_pending(self) -> list:
        """The untrained samples of partly trained prompts, kept beside the state (rank 0)."""
        return []

    def _get_output_dir(self, trial: Any) -> str:
        if self._checkpoint_staging is not None:
            return str(self._checkpoint_staging)
        return super()._get_output_dir(trial=trial)

    def _save_checkpoint(self, model: torch.nn.Module, trial: Any) -> None:
        """The Trainer's checkpoint plus rollout_state.json, written to a staging folder and renamed
        into place when complete (a full disk: `CheckpointDiskFullError` naming the path)."""
        from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, rotate_checkpoints

        run_dir = self._get_output_dir(trial=trial)
        folder = f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
        main = self.is_world_process_zero()
        with staged_checkpoint(run_dir, folder, is_main=main,
                               barrier=self.accelerator.wait_for_everyone) as staging:
            self._checkpoint_staging = staging
            try:
                super()._save_checkpoint(model, trial)
            finally:
                self._checkpoint_staging = None
            # the pending samples first: collecting them reads the queue, which may settle prompts
            pending = self._rollout_pending() if main else []
            state = self._rollout_state() if main else None
            if state is not None:
                write_rollout_state(staging / folder, state)
                if pending:
                    write_rollout_pending(staging / folder, pending)
        if self.args.should_save:  # the Trainer rotated the staging folder; the real one is here
            rotate_checkpoints(
                output_dir=run_dir, save_total_limit=self.args.save_total_limit,
                best_model_checkpoint=self.state.best_model_checkpoint, use_mtime=True,
            )
