"""Fault 7: checkpoints are written to a staging folder and renamed when complete; a full disk says so
with the path; resuming skips incomplete checkpoints."""

from __future__ import annotations

import errno
import logging
import shutil
from collections import namedtuple

import pytest
import torch
from fault_helpers import MODEL, short_run_config, spread_reward

from asyncgrpo import AsyncGRPOTrainer
from asyncgrpo.checkpoint import RolloutState, read_rollout_state, write_rollout_state
from asyncgrpo.tasks import arithmetic
from asyncgrpo.train import checkpoints
from asyncgrpo.train.checkpoints import (
    STAGING_DIR,
    CheckpointDiskFullError,
    is_out_of_space,
    last_complete_checkpoint,
    resolve_resume_checkpoint,
    staged_checkpoint,
)


def _complete(path, step):
    path.mkdir(parents=True)
    (path / "trainer_state.json").write_text("{}")
    write_rollout_state(path, RolloutState(step, step))
    return path


def _stage(tmp_path, write):
    with staged_checkpoint(tmp_path, "checkpoint-2", is_main=True, barrier=lambda: None) as staging:
        write(staging / "checkpoint-2")


def test_a_checkpoint_appears_only_once_complete(tmp_path):
    seen_during_write = []

    def write(folder):
        folder.mkdir()
        (folder / "model.safetensors").write_bytes(b"x")
        seen_during_write.append(last_complete_checkpoint(tmp_path))
        (folder / "trainer_state.json").write_text("{}")
        write_rollout_state(folder, RolloutState(3, 2))

    _stage(tmp_path, write)
    assert seen_during_write == [None]  # nothing under output_dir looked like a checkpoint meanwhile
    assert last_complete_checkpoint(tmp_path) == tmp_path / "checkpoint-2"
    assert read_rollout_state(tmp_path / "checkpoint-2") == RolloutState(3, 2)
    assert not (tmp_path / STAGING_DIR).exists()


def test_enospc_names_the_path_removes_the_partial_copy_and_keeps_earlier_checkpoints(tmp_path):
    _complete(tmp_path / "checkpoint-1", 1)

    def write(folder):
        folder.mkdir()
        (folder / "model.safetensors").write_bytes(b"x")
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(CheckpointDiskFullError, match="no space left on device while writing checkpoint to "
                                                      ".*checkpoint-2") as info:
        _stage(tmp_path, write)
    assert info.value.errno == errno.ENOSPC
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-1"]
    assert last_complete_checkpoint(tmp_path) == tmp_path / "checkpoint-1"


def test_other_save_errors_pass_through_and_leave_nothing_behind(tmp_path):
    def write(folder):
        folder.mkdir()
        raise PermissionError(errno.EACCES, "Permission denied")

    with pytest.raises(PermissionError):
        _stage(tmp_path, write)
    assert list(tmp_path.iterdir()) == []


def test_torch_and_safetensors_wordings_of_a_full_disk_are_recognised(tmp_path, monkeypatch):
    safetensors_error = RuntimeError('Error while serializing: IoError(Os { code: 28, kind: StorageFull, '
                                     'message: "No space left on device" })')
    assert is_out_of_space(safetensors_error, tmp_path)
    torch_error = RuntimeError("[enforce fail at inline_container.cc:664] . PytorchStreamWriter failed "
                               "writing file data/3: file write failed")
    wrapped = RuntimeError("saving the optimizer failed")
    wrapped.__cause__ = torch_error
    assert not is_out_of_space(wrapped, tmp_path)  # this disk has room: a write failed for another reason
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(checkpoints.shutil, "disk_usage", lambda path: usage(10**9, 10**9, 4096))
    assert is_out_of_space(wrapped, tmp_path)  # torch does not say why; a full disk does


def test_resume_skips_incomplete_checkpoints_with_a_warning_and_refuses_an_explicit_one(tmp_path, caplog):
    _complete(tmp_path / "checkpoint-2", 2)
    partial = tmp_path / "checkpoint-4"
    partial.mkdir()
    (partial / "model.safetensors").write_bytes(b"x")
    with caplog.at_level(logging.WARNING, logger="asyncgrpo.train.checkpoints"):
        assert resolve_resume_checkpoint(True, tmp_path) == str(tmp_path / "checkpoint-2")
    assert "skipping the incomplete checkpoint" in caplog.text and "checkpoint-4" in caplog.text
    with pytest.raises(ValueError, match="checkpoint-4 is incomplete"):
        resolve_resume_checkpoint(str(partial), tmp_path)
    shutil.rmtree(tmp_path / "checkpoint-2")
    with pytest.raises(ValueError, match="holds no complete checkpoint"):
        resolve_resume_checkpoint(True, tmp_path)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_trainer_disk_full_at_a_save_then_resume_past_a_partial_checkpoint(tmp_path,
                                                                           server, monkeypatch, caplog):
    out = tmp_path / "out"
    real_save = torch.save

    def save_until_full(obj, f, *args, **kwargs):
        if "checkpoint-2" in str(f):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", save_until_full)
    args = short_run_config(out, server.url, max_steps=3, save_strategy="steps", save_steps=1)
    trainer = AsyncGRPOTrainer(model=MODEL, reward_funcs=spread_reward,
                               train_dataset=arithmetic.make_dataset(32, seed=0), args=args)
    with pytest.raises(CheckpointDiskFullError,
                       match=f"no space left on device while writing checkpoint to {out}/checkpoint-2"):
        trainer.train()
    assert sorted(p.name for p in out.iterdir() if p.name.startswith(("checkpoint", "."))) == ["checkpoint-1"]
    monkeypatch.setattr(torch, "save", real_save)

    partial = out / "checkpoint-7"  # what a crash mid-save of an older version left
    partial.mkdir()
    (partial / "model.safetensors").write_bytes(b"truncated")
    resumed = AsyncGRPOTrainer(
        model=MODEL, reward_funcs=spread_reward, train_dataset=arithmetic.make_dataset(32, seed=0),
        args=short_run_config(out, server.url, max_steps=2),
    )
    with caplog.at_level(logging.WARNING, logger="asyncgrpo.train.checkpoints"):
        resumed.train(resume_from_checkpoint=True)
    assert "skipping the incomplete checkpoint" in caplog.text
    assert resumed.state.global_step == 2  # from checkpoint-1, one more step
