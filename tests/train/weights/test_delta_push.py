"""Weight deltas from the trainer (`weight_push="delta"`): the copy of the last push (train/weights/delta.py),
the factory's choice and its warnings (choose.py), and pushes into the embedded server over gloo
(collective.py): the server ends with exactly the trainer's weights after every push, a push after the
first sends only the changed words, and a server that holds another version, or refuses the delta, gets
the full weights. The server runs in bfloat16, as a GPU one would: most words of a step then stay."""

from __future__ import annotations

import json
import logging
import time
import urllib.request

import pytest
import torch
from transformers import AutoModelForCausalLM, TrainerCallback

from asyncgrpo import AsyncGRPOTrainer
from asyncgrpo.generation.server_info import ServerDevice, ServerInfo
from asyncgrpo.modeling.load import resolve_model_path
from asyncgrpo.sync.checksum import checksum_mismatches, weights_checksum
from asyncgrpo.sync.delta import DeltaUpdate, apply_delta, tensor_sketch
from asyncgrpo.sync.packed import TensorMeta
from asyncgrpo.sync.sender import DeltaRejected
from asyncgrpo.tasks import arithmetic
from asyncgrpo.train.server_link import ServerLink
from asyncgrpo.train.weights import WeightSettings, make_transport
from asyncgrpo.train.weights.choose import delta_refusal
from asyncgrpo.train.weights.collective import CollectiveTransport
from asyncgrpo.train.weights.delta import LastPush
from asyncgrpo.train.weights.gather import server_weight_metas, weights_for_server
from asyncgrpo.types import WeightVersion

TINY = "asyncgrpo/tiny-chat"
SERVED = torch.bfloat16


# -- the copy of the last push -----------------------------------------------------------------------


def named(seed: int, scale: float = 0.0, base: list | None = None) -> list[tuple[str, torch.Tensor]]:
    """Three bf16 tensors; with `base`, those moved by `scale` times noise (few words change at 1e-3)."""
    g = torch.Generator().manual_seed(seed)
    if base is None:
        return [(n, torch.randn(s, generator=g).to(SERVED)) for n, s in (("a", (64, 32)), ("b", (32,)),
                                                                          ("c", (16, 8)))]
    return [(n, (t.float() * (1 + scale * torch.randn(t.shape, generator=g))).to(SERVED)) for n, t in base]


def test_the_copy_of_the_last_push_gives_deltas_that_turn_the_servers_weights_into_the_new_ones():
    first = named(0)
    metas = [TensorMeta.of(n, t) for n, t in first]
    last = LastPush(torch.device("cpu"))
    assert last.advance(iter(first), metas) is None  # no base: the first push is full (from the copy)
    assert [t.data_ptr() for _, t in last.named_tensors(metas)] != [t.data_ptr() for _, t in first]
    last.label = "v0"  # the push landed
    second = named(1, 1e-3, first)
    update = last.advance(iter(second), metas)
    assert update.base_version == "v0" and last.label is None  # ahead of the server until it lands
    assert 0 < update.nbytes < update.full_nbytes
    server = [t.clone() for _, t in first]  # what the server holds
    for tensor, delta in zip(server, update.deltas):
        apply_delta(tensor, delta)
    for tensor, (name, new), sketch in zip(server, second, update.sketches):
        assert torch.equal(tensor.view(torch.int16), new.view(torch.int16)), name
        assert sketch == tensor_sketch(new), name
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(last.named_tensors(metas), second))
    last.forget()  # a failed push: the server's weights are unknown
    assert last.advance(iter(named(2, 1e-3, second)), metas) is None


def test_a_tensor_that_changed_too_much_is_sent_whole_from_the_copy():
    first = named(0)
    metas = [TensorMeta.of(n, t) for n, t in first]
    last = LastPush(torch.device("cpu"))
    last.advance(iter(first), metas)
    last.label = "v0"
    moved = [(n, t + 1 if n == "a" else t) for n, t in first]
    update = last.advance(iter(moved), metas)
    assert [d.num_changed for d in update.deltas] == [-1, 0, 0]
    assert update.deltas[0].values.data_ptr() == last.tensors["a"].data_ptr()  # no second copy
    assert update.nbytes == metas[0].nbytes


# -- the factory ----------------------------------------------------------------------------------------


class FakeLink:
    base_url = "http://127.0.0.1:8000"
    client = None
    timeout_s = 30.0


def info(device: ServerDevice | None) -> ServerInfo:
    return ServerInfo(
        version="0.33.0", dialect=(0, 33, 0), model_name="m", max_model_len=256, dtype="bfloat16",
        logprobs_mode="processed_logprobs", supports_generate=True, supports_sampling_mask=True,
        has_metrics=True, kv_cache_tokens=None, world_size=1, dev_mode=True, device=device,
    )


def settings(weight_push: str) -> WeightSettings:
    return WeightSettings(device=torch.device("cpu"), world_size=1, max_staleness=1, output_dir="out",
                          timeout_s=30.0, api_key=None, weight_push=weight_push)


EMBEDDED = ServerDevice("cpu", None, "gloo", accepts_ipc=False, embedded=True, accepts_deltas=True)
VLLM = ServerDevice(None, None, "nccl", accepts_ipc=False, embedded=False)
OLD_EMBEDDED = ServerDevice("cpu", None, "gloo", accepts_ipc=False, embedded=True)


def test_the_factory_pushes_deltas_only_into_a_server_that_takes_them_and_says_why_not_once(caplog):
    model = torch.nn.Linear(2, 2)
    with caplog.at_level(logging.WARNING, logger="asyncgrpo.train.weights.choose"):
        delta = make_transport(FakeLink(), info(EMBEDDED), model, settings("delta")).transport
        full = make_transport(FakeLink(), info(EMBEDDED), model, settings("full")).transport
    assert isinstance(delta, CollectiveTransport) and isinstance(delta.last, LastPush)
    assert full.last is None and caplog.records == []
    for server, reason in ((VLLM, "vLLM takes no weight deltas"), (OLD_EMBEDDED, "an older asyncgrpo")):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="asyncgrpo.train.weights.choose"):
            transport = make_transport(FakeLink(), info(server), model, settings("delta")).transport
        assert transport.last is None
        assert len(caplog.records) == 1 and reason in caplog.text
        assert "every push sends the full weights" in caplog.text and "weight_push='full'" in caplog.text
    assert "sharded (FSDP2)" in delta_refusal(EMBEDDED, sharded=True)
    assert delta_refusal(EMBEDDED, sharded=False) is None


# -- pushes into the embedded server ------------------------------------------------------------------


@pytest.fixture
def server(embedded_server):
    return embedded_server(TINY, "--dtype", "bfloat16", purpose="trained")  # pushes change its weights


def served_matches(link: ServerLink, model: torch.nn.Module) -> list[str]:
    """Names whose served digest differs from the trainer's weights in the serving dtype."""
    ours = weights_checksum(weights_for_server(model, SERVED))
    return checksum_mismatches(ours, link.run(link.client.weight_checksum()))


def nudge(model: torch.nn.Module, seed: int, scale: float = 3e-4) -> None:
    """A step's worth of change: each weight moved by a small relative amount (a few % of bf16 words)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1 + scale * torch.randn(p.shape, generator=g))


@pytest.fixture
def pushing(server):
    """A delta-pushing transport (as the trainer makes it) into the server, and a float32 tiny model."""
    link = ServerLink(server.url, timeout_s=60)
    model = AutoModelForCausalLM.from_pretrained(resolve_model_path(TINY), dtype=torch.float32)
    transport = make_transport(link, link.connect(), model, settings("delta"))
    transport.init()
    yield link, model, transport
    transport.close()
    link.close()


def test_delta_pushes_leave_the_server_with_the_trainers_weights_and_send_only_the_changed_words(pushing):
    link, model, transport = pushing
    full = sum(m.nbytes for m in server_weight_metas(model, SERVED))
    first = transport.push(model, WeightVersion(0))
    assert first["delta"] == 0.0 and first["bytes"] == full and served_matches(link, model) == []
    for version in (1, 2, 3):
        nudge(model, version)
        pushed = transport.push(model, WeightVersion(version))
        assert pushed["delta"] == 1.0 and 0 < pushed["bytes"] < 0.5 * full, pushed
        assert served_matches(link, model) == []
        assert link.run(link.client.weight_info()) == WeightVersion(version).label()


def test_a_server_that_holds_another_version_gets_the_full_weights(pushing, caplog):
    link, model, transport = pushing
    transport.push(model, WeightVersion(0))
    request = urllib.request.Request(f"{link.base_url}/update_weight_version", method="POST",
                                     data=json.dumps({"new_version": "another trainer's"}).encode(),
                                     headers={"Content-Type": "application/json"})
    urllib.request.urlopen(request, timeout=30).close()
    nudge(model, 1)
    with caplog.at_level(logging.WARNING, logger="asyncgrpo.train.weights.collective"):
        pushed = transport.push(model, WeightVersion(1))
    assert pushed["delta"] == 0.0 and "serves weight version \"another trainer's\"" in caplog.text
    assert served_matches(link, model) == []
    nudge(model, 2)
    assert transport.push(model, WeightVersion(2))["delta"] == 1.0  # deltas again from there
    assert served_matches(link, model) == []


def test_the_server_refuses_a_delta_of_another_base_or_result_and_the_group_stays_in_step(
    pushing, caplog, monkeypatch
):
    link, model, transport = pushing
    collective = transport.transport
    transport.push(model, WeightVersion(0))
    nudge(model, 1)
    update = collective.last.advance(weights_for_server(model, SERVED), server_weight_metas(model, SERVED))
    sender = collective.sender
    send = sender._send

    def slow_send(buffer, stream):  # the server's refusal overtakes the broadcast's return, as under load
        send(buffer, stream)
        time.sleep(0.5)

    monkeypatch.setattr(sender, "_send", slow_send)

    async def push_delta(delta: DeltaUpdate) -> str:
        await link.client.pause(mode="keep")
        try:
            with pytest.raises(DeltaRejected) as refused:
                await sender.push_delta(delta, version="v1")
            return str(refused.value)
        finally:
            await link.client.resume()

    other_base = DeltaUpdate(update.metas, update.deltas, update.sketches, base_version="v7")
    assert "applies to version 'v7' and this server holds 'v0'" in link.run(push_delta(other_base))
    assert link.run(link.client.weight_info()) == "v0"
    wrong = DeltaUpdate(update.metas, update.deltas, ((1, 2), *update.sketches[1:]), base_version="v0")
    message = link.run(push_delta(wrong))
    assert f"1 of {len(update.metas)} tensors differ from the trainer's ({update.metas[0].name})" in message
    monkeypatch.undo()
    # the same group then takes the next push, which the trainer sends full after a refused delta
    collective.last.forget()
    pushed = transport.push(model, WeightVersion(1))
    assert pushed["delta"] == 0.0 and served_matches(link, model) == []
    # and a refusal seen by the transport itself ends in the full weights, with a warning
    nudge(model, 2)
    advance = collective.last.advance

    def advance_with_a_wrong_sketch(named_tensors, metas):
        update = advance(named_tensors, metas)
        return DeltaUpdate(update.metas, update.deltas, ((1, 2), *update.sketches[1:]), update.base_version)

    collective.last.advance = advance_with_a_wrong_sketch
    with caplog.at_level(logging.WARNING, logger="asyncgrpo.train.weights.collective"):
        pushed = transport.push(model, WeightVersion(2))
    assert pushed["delta"] == 0.0 and "refused the weight delta" in caplog.text
    assert served_matches(link, model) == [] and link.run(link.client.weight_info()) == "v2"


# -- training ---------------------------------------------------------------------------------------------


def spread_reward(completions, **kwargs) -> list[float]:
    """0, 1, 2, ... within every group: no group is dropped for equal rewards."""
    return [float(i) for i in range(len(completions))]


class ServedWeights(TrainerCallback):
    """At every log (after the step's sync): whether the server serves exactly the trainer's weights."""

    def __init__(self, url: str) -> None:
        self.link = ServerLink(url, timeout_s=60)
        self.mismatches: list[list[str]] = []

    def on_log(self, args, state, control, model=None, logs=None, **kwargs):
        if logs and "perf/weight_sync_bytes" in logs:
            self.mismatches.append(served_matches(self.link, model))


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_training_with_delta_pushes_keeps_the_server_on_the_trainers_weights(tmp_path, server):
    from support.short_run import short_run_config

    served = ServedWeights(server.url)
    args = short_run_config(tmp_path / "out", server.url, max_steps=3, learning_rate=1e-5,
                            weight_push="delta")
    trainer = AsyncGRPOTrainer(model=TINY, reward_funcs=spread_reward, args=args, callbacks=[served],
                               train_dataset=arithmetic.make_dataset(32, seed=0))
    try:
        trainer.train()
    finally:
        served.link.close()
    full = sum(m.nbytes for m in server_weight_metas(trainer.model, SERVED))
    logs = [e for e in trainer.state.log_history if "perf/weight_sync_bytes" in e]
    assert len(logs) == 3 and served.mismatches == [[], [], []]
    for entry in logs:  # every step's push is a delta (the first, full, push was at train() start)
        assert entry["perf/weight_sync_delta_frac"] == 1.0
        assert 0 < entry["perf/weight_sync_bytes"] < 0.5 * full, (entry["perf/weight_sync_bytes"], full)
