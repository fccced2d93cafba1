"""Fault 1 end to end: an inf reward or a NaN gradient during a real run (embedded server, tiny model)
leaves the trainer's weights finite and the server serving exactly the trainer's weights."""

from __future__ import annotations

import asyncio

import pytest
import torch
from fault_helpers import MODEL, short_run_config, spread_reward
from transformers import TrainerCallback

from asyncgrpo import AsyncGRPOTrainer
from asyncgrpo.generation.client import GenerationClient
from asyncgrpo.sync.checksum import checksum_mismatches, weights_checksum
from asyncgrpo.tasks import arithmetic
from asyncgrpo.train.weights.gather import weights_for_server

pytestmark = pytest.mark.process


class InfOnThirdGroup:
    """spread_reward, but the third group it scores gets +inf for its first completion."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, completions, **kwargs):
        self.calls += 1
        rewards = spread_reward(completions)
        if self.calls == 3:
            rewards[0] = float("inf")
        return rewards


def _served_checksum(url: str) -> dict[str, str]:
    async def fetch():
        async with GenerationClient(url, timeout_s=60) as client:
            return await client.weight_checksum()

    return asyncio.run(fetch())


def _assert_finite_and_served(trainer, url):
    for name, param in trainer.model.named_parameters():
        assert torch.isfinite(param).all(), f"{name} holds inf/NaN"
    ours = weights_checksum(weights_for_server(trainer.model, torch.float32))
    assert checksum_mismatches(ours, _served_checksum(url)) == [], (
        "the server does not serve the trainer's weights"
    )


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_an_inf_reward_stops_the_run_naming_the_function_and_nothing_nan_reaches_the_server(tmp_path, server):
    trainer = AsyncGRPOTrainer(
        model=MODEL, reward_funcs=InfOnThirdGroup(), train_dataset=arithmetic.make_dataset(32, seed=0),
        args=short_run_config(tmp_path / "out", server.url, max_steps=20, max_concurrent_rollouts=4),
    )
    with pytest.raises(
        RuntimeError, match=r"reward function 'InfOnThirdGroup' returned inf for completion 0"
    ):
        trainer.train()
    _assert_finite_and_served(trainer, server.url)


class NanGradientAtStep2(AsyncGRPOTrainer):
    """Poisons one gradient entry in the second optimizer step."""

    def training_step(self, model, inputs, num_items_in_batch=None):
        loss = super().training_step(model, inputs, num_items_in_batch)
        if self.state.global_step == 1:
            next(p for p in model.parameters() if p.grad is not None).grad.view(-1)[0] = float("nan")
        return loss


class Snapshots(TrainerCallback):
    """The weights at the start and at the end of every step."""

    def __init__(self) -> None:
        self.begin: dict[int, dict] = {}
        self.end: dict[int, dict] = {}

    def on_step_begin(self, args, state, control, model=None, **kwargs):
        self.begin[state.global_step + 1] = {n: p.detach().clone() for n, p in model.named_parameters()}

    def on_step_end(self, args, state, control, model=None, **kwargs):
        self.end[state.global_step] = {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_nan_gradient_skips_the_step_and_the_push_and_training_goes_on(tmp_path, server):
    snapshots = Snapshots()
    trainer = NanGradientAtStep2(
        model=MODEL, reward_funcs=spread_reward, train_dataset=arithmetic.make_dataset(32, seed=1),
        args=short_run_config(tmp_path / "out", server.url, max_steps=3), callbacks=[snapshots],
    )
    trainer.train()
    assert trainer.state.global_step == 3
    for name, before in snapshots.begin[2].items():
        assert torch.equal(before, snapshots.end[2][name]), f"step 2 moved {name}"
    assert any(not torch.equal(snapshots.begin[3][n], snapshots.end[3][n]) for n in snapshots.end[3]), \
        "the step after the skipped one did not train"
    counts = [
        e["optimizer/nonfinite_step_count"]
        for e in trainer.state.log_history
        if "optimizer/nonfinite_step_count" in e
    ]
    assert counts == [0, 1, 0]
    _assert_finite_and_served(trainer, server.url)
