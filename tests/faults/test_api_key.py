"""With an API key, every route of the embedded server but /health needs it, and the trainer and its
rollout process send it (item 3 of the fault list: an unauthenticated client could pause the server
and push weights)."""

from __future__ import annotations

import os

import pytest
from fault_helpers import TINY, call

from asyncgrpo.server.app import ROUTES, UNGUARDED_PATHS

pytestmark = pytest.mark.process

KEY = "k-3f9a1c"


@pytest.fixture(scope="module")
def keyed_server(tmp_path_factory):
    """The key comes from VLLM_API_KEY, as with `vllm serve`."""
    from asyncgrpo.launch import EmbeddedServer

    log = tmp_path_factory.mktemp("server") / "server.log"
    with EmbeddedServer(TINY, log_path=log, extra_args=["--max-model-len", "256"],
                        env={"VLLM_API_KEY": KEY}) as server:
        yield server


@pytest.mark.parametrize("method,path", [(m, p) for m, p, _ in ROUTES if p not in UNGUARDED_PATHS])
def test_every_route_but_health_refuses_a_missing_or_wrong_key(keyed_server, method, path):
    body = {} if method == "POST" else None
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY},
                    {"Authorization": f"Basic {KEY}"}):
        status, out = call(keyed_server.url, method, path, body, headers)
        assert (status, out) == (401, {"error": "Unauthorized"}), (headers, status, out)


def test_state_is_unchanged_by_refused_requests_and_the_key_opens_every_route(keyed_server):
    auth = {"Authorization": f"Bearer {KEY}"}
    assert call(keyed_server.url, "GET", "/health")[0] == 200
    assert call(keyed_server.url, "POST", "/pause?mode=keep")[0] == 401
    assert call(keyed_server.url, "GET", "/is_paused", headers=auth) == (200, {"is_paused": False})
    for method, path, _ in ROUTES:
        if method == "GET":
            assert call(keyed_server.url, method, path, headers=auth)[0] == 200, path
    status, out = call(keyed_server.url, "POST", "/v1/completions", {"prompt": "hi", "max_tokens": 2}, auth)
    assert status == 200, out


@pytest.mark.slow
def test_trainer_and_rollout_process_train_against_a_keyed_server(keyed_server, tmp_path, monkeypatch):
    from datasets import Dataset

    from asyncgrpo import AsyncGRPOConfig, AsyncGRPOTrainer
    from asyncgrpo.rewards import accuracy_reward
    from asyncgrpo.tasks import arithmetic

    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    config = AsyncGRPOConfig(
        output_dir=str(tmp_path / "out"), vllm_server_base_url=keyed_server.url, vllm_server_api_key=KEY,
        vllm_server_timeout=60, num_generations=4, max_completion_length=16, max_steps=1, learning_rate=1e-4,
        bf16=False, use_cpu=True, gradient_checkpointing=False, save_strategy="no", report_to="none",
        disable_tqdm=True, logging_steps=1, seed=0,
    )
    trainer = AsyncGRPOTrainer(model=TINY, reward_funcs=accuracy_reward, args=config,
                               train_dataset=Dataset.from_list(arithmetic.make_dataset(32, seed=0)))
    trainer.train()
    assert trainer.state.global_step == 1
    # the pushed weights arrived: the server's version moved past "default"
    status, info = call(keyed_server.url, "GET", "/weight_info", headers={"Authorization": f"Bearer {KEY}"})
    assert status == 200 and info["weight_version"] != "default"
    assert "VLLM_API_KEY" not in os.environ


def test_a_link_without_the_key_is_refused_naming_the_setting(keyed_server):
    from asyncgrpo.generation.transport import ServerRequestError
    from asyncgrpo.train.server_link import ServerLink

    link = ServerLink(keyed_server.url, timeout_s=20)
    try:
        with pytest.raises(ServerRequestError, match="401.*vllm_server_api_key.*VLLM_API_KEY"):
            link.connect()
    finally:
        link.close()
