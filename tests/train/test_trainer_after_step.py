"""AsyncGRPOTrainer's after-step protocol without a server: a fake weight transport takes the pushes
(a `FullWeights`, so the trainer's push gathers the served weights as it does for the real ones).

The Trainer's own callback handler drives the steps (`on_step_end`), as the training loop does.
"""

from __future__ import annotations

import json

import pytest
import torch

from asyncgrpo import AsyncGRPOConfig, AsyncGRPOTrainer
from asyncgrpo import metrics as M
from asyncgrpo.rewards import accuracy_reward
from asyncgrpo.sync.checksum import tensor_digest
from asyncgrpo.tasks import arithmetic
from asyncgrpo.train.weights.base import FullWeights, OtherRank
from asyncgrpo.train.weights.gather import server_weight_metas, weights_for_server
from asyncgrpo.types import WeightVersion, adapter_name_template

pytestmark = pytest.mark.engine


class RecordingTransport(FullWeights):
    """A full-weight transport that keeps what it was sent (checksums per label); fails when told to."""

    def __init__(self, fail: bool = False) -> None:
        super().__init__(torch.float32)
        self.fail = fail
        self.pushes: dict[str, dict[str, str]] = {}

    def send(self, named_tensors, *, label, metas=None):
        received = {}
        for meta, (name, tensor) in zip(metas, named_tensors, strict=True):
            assert (name, tensor.dtype, tuple(tensor.shape)) == (meta.name, meta.dtype, meta.shape)
            if self.fail:
                raise ConnectionError("the server went away")
            received[name] = tensor_digest(tensor)
        self.pushes[label] = received
        return {"total_s": 0.5, "pause_s": 0.1, "transfer_s": 0.3, "resume_s": 0.1}


def _trainer(tmp_path, **overrides) -> AsyncGRPOTrainer:
    config = AsyncGRPOConfig(
        output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to="none", disable_tqdm=True,
        save_strategy="no", logging_steps=1, max_steps=4, **overrides,
    )
    return AsyncGRPOTrainer(
        model="asyncgrpo/tiny-chat", reward_funcs=accuracy_reward,
        train_dataset=arithmetic.make_dataset(8, seed=0), args=config,
    )


def _step(trainer: AsyncGRPOTrainer) -> None:
    """The end of one optimizer step, as the Trainer's loop signals it."""
    trainer.state.global_step += 1
    trainer.callback_handler.on_step_end(trainer.args, trainer.state, trainer.control)


def _served_digests(trainer: AsyncGRPOTrainer) -> dict[str, str]:
    return {name: tensor_digest(t) for name, t in weights_for_server(trainer.model, torch.float32)}


def test_each_step_pushes_every_served_weight_labelled_with_its_version_and_bumps_the_version(tmp_path):
    trainer = _trainer(tmp_path)
    transport = trainer.weights = RecordingTransport()
    assert trainer.model_version == 0
    _step(trainer)
    assert list(transport.pushes) == ["v1"]
    assert list(transport.pushes["v1"]) == [m.name for m in server_weight_metas(trainer.model, torch.float32)]
    assert transport.pushes["v1"] == _served_digests(trainer)
    assert trainer.model_version == 1 and isinstance(trainer.model_version, WeightVersion)
    with torch.no_grad():  # what the next push sends is the model as it is then
        next(trainer.model.parameters()).add_(1.0)
    _step(trainer)
    assert trainer.model_version == 2
    assert transport.pushes["v2"] == _served_digests(trainer) != transport.pushes["v1"]


def test_weight_sync_steps_pushes_every_nth_step_only_labelled_with_the_version_not_the_step(tmp_path):
    trainer = _trainer(tmp_path, weight_sync_steps=2)
    transport = trainer.weights = RecordingTransport()
    versions = []
    for _ in range(4):
        _step(trainer)
        versions.append(trainer.model_version)
    assert list(transport.pushes) == ["v1", "v2"]
    assert versions == [0, 1, 1, 2]


def test_the_push_timings_are_logged_as_weight_sync_metrics(tmp_path):
    trainer = _trainer(tmp_path)
    trainer.weights = RecordingTransport()
    _step(trainer)
    trainer.log({})
    logged = trainer.state.log_history[-1]
    assert logged[M.PERF_WEIGHT_SYNC_S] == pytest.approx(0.5)
    assert logged[M.PERF_WEIGHT_SYNC_TRANSFER_S] == pytest.approx(0.3)
    assert logged[M.OPTIMIZER_NONFINITE_STEP_COUNT] == 0


def test_a_failed_push_raises_and_the_version_stays(tmp_path):
    trainer = _trainer(tmp_path)
    trainer.weights = RecordingTransport(fail=True)
    with pytest.raises(ConnectionError, match="went away"):
        _step(trainer)
    assert trainer.model_version == 0


def test_a_replica_pushes_nothing_but_counts_the_version(tmp_path):
    """A data-parallel replica (rank > 0) sends nothing: rank 0 sends the same weights alone."""
    trainer = _trainer(tmp_path)
    trainer.weights = OtherRank(torch.float32)
    _step(trainer)
    assert trainer.model_version == 1
    assert trainer.weights.push(trainer.model, trainer.model_version.next()) == {}  # nothing timed


def test_the_version_labels_and_names_what_the_server_serves():
    version = WeightVersion(3)
    assert (version.label(), version.adapter_name(), version.adapter_name("mine")) == (
        "v3", "asyncgrpo-lora-v3", "mine-v3")
    assert version.next() == 4 and isinstance(version.next(), WeightVersion)
    assert adapter_name_template().format(version=version) == version.adapter_name()
    assert json.loads(json.dumps({"v": version})) == {"v": 3}  # stored as a plain number
