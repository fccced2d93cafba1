"""A short training run against two embedded servers (CPU, bundled tiny model): the rollout groups are
spread over both, and every weight sync reaches both, so that after the run each serves exactly the
trainer's weights under the trainer's weight version."""

from __future__ import annotations

import asyncio

import pytest
import torch
from support.short_run import short_run_config

from asyncgrpo import AsyncGRPOTrainer
from asyncgrpo.generation.client import GenerationClient
from asyncgrpo.sync.checksum import checksum_mismatches, weights_checksum
from asyncgrpo.tasks import arithmetic
from asyncgrpo.train.weights.gather import weights_for_server
from asyncgrpo.types import WeightVersion

pytestmark = pytest.mark.process

MODEL = "asyncgrpo/tiny-chat"


@pytest.fixture
def servers(embedded_server):
    """Two servers of their own: the run leaves its weights in both."""
    return [embedded_server(MODEL, purpose=f"several-servers-{i}") for i in range(2)]


def spread_reward(completions, **kwargs) -> list[float]:
    """0, 1, 2, ... within every group: no group is dropped for equal rewards."""
    return [float(i) for i in range(len(completions))]


def _served(url: str) -> tuple[float, dict[str, str], str]:
    """The tokens the server has generated so far, the checksum of its weights, its weight version."""
    async def fetch():
        async with GenerationClient(url, timeout_s=60) as client:
            generated = (await client.metrics()).generation_tokens or 0.0
            return generated, await client.weight_checksum(), await client.weight_info()

    return asyncio.run(fetch())


@pytest.mark.timeout(240)
def test_a_run_spreads_its_groups_over_two_servers_and_leaves_both_serving_its_weights(tmp_path, servers):
    urls = [server.url for server in servers]
    generated_before = [_served(url)[0] for url in urls]
    trainer = AsyncGRPOTrainer(
        model=MODEL, reward_funcs=spread_reward, train_dataset=arithmetic.make_dataset(64, seed=0),
        # rows of a few groups (token_budget): a step waits for less generation
        args=short_run_config(tmp_path / "out", urls, max_steps=3, token_budget=256),
    )
    trainer.train()

    assert trainer.state.global_step == 3
    ours = weights_checksum(weights_for_server(trainer.model, torch.float32))
    for url, before in zip(urls, generated_before):
        generated, checksum, version = _served(url)
        assert generated > before, f"the server at {url} generated nothing: the groups all went elsewhere"
        assert checksum_mismatches(ours, checksum) == [], f"{url} does not serve the trainer's weights"
        assert version == WeightVersion(trainer.state.global_step).label() == "v3"
    logged = set().union(*(entry for entry in trainer.state.log_history if "loss" in entry))
    for name in ("perf/weight_sync_s", "perf/weight_sync_s/0", "perf/weight_sync_s/1",
                 "rollout/concurrency", "rollout/concurrency/0", "rollout/concurrency/1",
                 "rollout/concurrency_cap/0", "rollout/concurrency_cap/1"):
        assert name in logged, f"{name} missing from the logged metrics: {sorted(logged)}"
