"""The weight transports without a server: the factory's choice, and restart recovery as a wrapper.

`make_transport` is the one place that picks how the weights reach the server (train/weights/choose.py);
`ServerRestarts` recovers a restarted server through the transport it wraps, with no call back into the
trainer (train/weights/restarts.py). A fake link stands in for `ServerLink`: none of these make a request.
"""

from __future__ import annotations

import pytest
import torch

from asyncgrpo.generation.client import ServerRestartedError
from asyncgrpo.generation.server_info import LoraServing, ServerInfo
from asyncgrpo.train.weights import WeightSettings, make_transport
from asyncgrpo.train.weights.adapters import AdapterSync
from asyncgrpo.train.weights.base import FullWeights, OtherRank
from asyncgrpo.train.weights.collective import CollectiveTransport
from asyncgrpo.train.weights.restarts import ServerRestarts
from asyncgrpo.types import WeightVersion

URL = "http://127.0.0.1:8000"


class FakeLink:
    """What the transports read of a `ServerLink` before they talk to the server."""

    def __init__(self, restarted: bool = False) -> None:
        self.base_url = URL
        self.client = None
        self.timeout_s = 30.0
        self._restarted = restarted

    def restarted(self) -> bool:
        return self._restarted


class Recorder(FullWeights):
    """A full-weight transport that notes its calls; its first `fail` pushes find a restarted server."""

    def __init__(self, fail: int = 0) -> None:
        super().__init__(torch.float32)
        self.fail = fail
        self.calls: list[str] = []

    def init(self) -> None:
        self.calls.append("init")

    def push(self, model, version):
        self.calls.append(f"push {version.label()}")
        if self.fail:
            self.fail -= 1
            raise ServerRestartedError(URL, "failed a weight push and serves weights no trainer pushed")
        return {"total_s": 1.0}

    def send(self, named_tensors, *, label, metas=None):
        raise AssertionError("push is overridden")

    def close(self) -> None:
        self.calls.append("close")


def _info(lora: LoraServing | None = None) -> ServerInfo:
    return ServerInfo(
        version="0.33.0+embedded", dialect=(0, 33, 0), model_name="m", max_model_len=256, dtype="bfloat16",
        logprobs_mode=None, supports_generate=True, supports_sampling_mask=True, has_metrics=True,
        kv_cache_tokens=None, world_size=1, dev_mode=True, lora=lora,
    )


def _settings(world_size: int = 1) -> WeightSettings:
    return WeightSettings(device=torch.device("cpu"), world_size=world_size, max_staleness=1,
                          output_dir="out", timeout_s=30.0, api_key=None)


def test_the_factory_gives_the_full_weights_to_a_cpu_trainer_over_gloo_with_restart_recovery():
    transport = make_transport(FakeLink(), _info(), torch.nn.Linear(2, 2), _settings())
    assert isinstance(transport, ServerRestarts) and isinstance(transport.transport, CollectiveTransport)
    assert str(transport) == "CollectiveTransport(gloo)" and transport.lora_name is None
    assert transport.transport.dtype == torch.bfloat16  # the server's dtype


def test_the_factory_gives_other_ranks_a_transport_that_sends_nothing():
    transport = make_transport(None, _info(), torch.nn.Linear(2, 2), _settings(world_size=2))
    assert isinstance(transport, OtherRank)
    assert transport.push(torch.nn.Linear(2, 2), WeightVersion(1)) == {}  # a replica: rank 0 sends


def test_the_factory_gives_a_peft_run_adapter_only_sync_when_the_server_serves_lora_at_run_time():
    peft = pytest.importorskip("peft")
    config = peft.LoraConfig(r=8, target_modules=["q_proj"])
    lora = LoraServing(max_lora_rank=8, max_loras=3, runtime_updating=True)
    served = make_transport(FakeLink(), _info(lora), torch.nn.Linear(2, 2), _settings(), peft_config=config)
    assert isinstance(served, AdapterSync) and served.dtype == torch.bfloat16
    assert served.lora_name == "asyncgrpo-lora-v{version}"
    assert served.lora_name.format(version=WeightVersion(3)) == WeightVersion(3).adapter_name()
    merged = make_transport(FakeLink(), _info(None), torch.nn.Linear(2, 2), _settings(), peft_config=config)
    assert isinstance(merged, ServerRestarts) and merged.lora_name is None


def test_a_push_that_finds_a_restarted_server_sets_the_transport_up_again_and_pushes_once_more():
    inner = Recorder(fail=1)
    restarts = ServerRestarts(inner, FakeLink(), world_size=1)
    assert restarts.push(torch.nn.Linear(2, 2), WeightVersion(4)) == {"total_s": 1.0}
    assert inner.calls == ["push v4", "close", "init", "push v4"] and restarts.recoveries == 1


def test_several_training_processes_stop_on_a_restarted_server():
    restarts = ServerRestarts(Recorder(fail=1), FakeLink(), world_size=2)
    with pytest.raises(ServerRestartedError, match="2 training processes cannot push them again mid-step"):
        restarts.push(torch.nn.Linear(2, 2), WeightVersion(4))


def test_while_the_trainer_waits_a_restarted_server_gets_the_current_version_at_most_every_few_seconds(
    monkeypatch,
):
    import asyncgrpo.train.weights.restarts as restarts_module

    inner = Recorder()
    restarts = ServerRestarts(inner, FakeLink(restarted=True), world_size=1)
    restarts.idle(torch.nn.Linear(2, 2), WeightVersion(2))
    assert inner.calls == []  # checked at most every CHECK_EVERY_S
    monkeypatch.setattr(restarts_module, "CHECK_EVERY_S", 0.0)
    restarts.idle(torch.nn.Linear(2, 2), WeightVersion(2))
    assert inner.calls == ["close", "init", "push v2"] and restarts.recoveries == 1
