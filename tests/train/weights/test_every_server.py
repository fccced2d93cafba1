"""The weight push to several servers (train/weights/every_server.py, `choose.make_transports`) without a
server: one transport per server, all servers paused around the pushes, the timings of the whole sync and
of each server. Fake transports note their calls; fake links (tests/support/fake_links.py) pause."""

from __future__ import annotations

import pytest
import torch
from support.fake_links import links
from test_weight_transports import FakeLink, _info, _settings

from asyncgrpo.train.weights.base import OtherRank
from asyncgrpo.train.weights.choose import make_transports
from asyncgrpo.train.weights.every_server import EveryServer, every_server_timings
from asyncgrpo.train.weights.restarts import ServerRestarts
from asyncgrpo.types import WeightVersion


class Noting:
    """A transport that notes its push, whether its server's link was held paused meanwhile, and fails
    if told to."""

    def __init__(self, name: str, events: list[str], link=None, fails: bool = False,
                 lora_name: str | None = None) -> None:
        self.name, self.events, self.link, self.fails, self.lora_name = name, events, link, fails, lora_name

    def init(self) -> None:
        self.events.append(f"init {self.name}")

    def push(self, model, version):
        held = self.link is not None and self.link.held
        self.events.append(f"push {self.name} {version.label()}{' held' if held else ''}")
        if self.fails:
            raise RuntimeError(f"the push to {self.name} failed")
        return {"pause_s": 0.0, "transfer_s": 2.0, "resume_s": 0.0, "total_s": 2.0, "bytes": 100.0,
                "num_chunks": 1.0}

    def idle(self, model, version) -> None:
        self.events.append(f"idle {self.name}")

    def close(self) -> None:
        self.events.append(f"close {self.name}")


def test_every_server_is_paused_then_pushed_one_after_the_other_then_resumed():
    group, events = links(None, None)
    weights = EveryServer([Noting(f"t{i}", events, link) for i, link in enumerate(group)], group)
    timings = weights.push(torch.nn.Linear(1, 1), WeightVersion(3))
    pushes = [e for e in events if e.startswith("push")]
    assert pushes == ["push t0 v3 held", "push t1 v3 held"]  # in server order, every server paused
    assert all(e.startswith("pause") for e in events[:2]) and all(e.startswith("resume") for e in events[4:])
    assert timings["transfer_s"] == 4.0 and timings["bytes"] == 200.0 and timings["num_chunks"] == 2.0
    assert timings["total_s"] >= max(timings["pause_s"], timings["resume_s"])
    for i in range(2):  # each server's part: its pause, its push, its resume
        assert timings[f"total_s/{i}"] >= 2.0


def test_a_failed_push_stops_the_sync_before_the_next_server_and_resumes_them_all():
    group, events = links(None, None, None)
    transports = [Noting(f"t{i}", events, link, fails=i == 1) for i, link in enumerate(group)]
    with pytest.raises(RuntimeError, match="the push to t1 failed"):
        EveryServer(transports, group).push(torch.nn.Linear(1, 1), WeightVersion(1))
    assert [e for e in events if e.startswith("push")] == ["push t0 v1 held", "push t1 v1 held"]
    assert sum(e.startswith("resume") for e in events) == 3


def test_adapter_transports_pause_no_server_as_with_one_server():
    group, events = links(None, None)
    transports = [Noting(f"t{i}", events, link, lora_name="lora-v{version}") for i, link in enumerate(group)]
    weights = EveryServer(transports, group)
    assert weights.lora_name == "lora-v{version}"
    timings = weights.push(torch.nn.Linear(1, 1), WeightVersion(2))
    assert events == ["push t0 v2", "push t1 v2"] and timings["pause_s"] == 0


def test_servers_that_take_the_weights_differently_are_refused():
    events: list[str] = []
    with pytest.raises(ValueError, match="full weights to server 0, LoRA adapters to server 1"):
        EveryServer([Noting("t0", events), Noting("t1", events, lora_name="lora-v{version}")], None)


def test_init_idle_and_close_reach_every_transport_and_close_survives_a_failure():
    events: list[str] = []

    class FailsToClose(Noting):
        def close(self) -> None:
            super().close()
            raise RuntimeError("close failed")

    weights = EveryServer([FailsToClose("t0", events), Noting("t1", events)], None)
    weights.init()
    weights.idle(None, WeightVersion(0))
    with pytest.raises(RuntimeError, match="close failed"):
        weights.close()
    assert events == ["init t0", "init t1", "idle t0", "idle t1", "close t0", "close t1"]


def test_the_timings_add_the_pushes_and_take_the_longest_pause_and_resume():
    part = {"pause_s": 0.0, "transfer_s": 1.5, "resume_s": 0.0, "total_s": 1.5, "bytes": 10.0,
            "num_chunks": 2.0}
    timings = every_server_timings([part, {**part, "transfer_s": 0.5, "total_s": 0.5}],
                                   pause_s=[0.1, 0.3], resume_s=[0.2, 0.05], total_s=2.6)
    assert timings == pytest.approx({
        "total_s": 2.6, "pause_s": 0.3, "resume_s": 0.2, "transfer_s": 2.0, "bytes": 20.0, "num_chunks": 4.0,
        "total_s/0": 1.8, "total_s/1": 0.85,
    })
    assert every_server_timings([{}, {}], pause_s=[0, 0], resume_s=[0, 0], total_s=0.1) == {}  # other ranks


def test_one_server_gets_its_transport_alone_several_get_one_each_behind_every_server():
    model = torch.nn.Linear(2, 2)
    one = make_transports([FakeLink()], [_info()], model, _settings())
    assert isinstance(one, ServerRestarts)  # as make_transport gives it: the single-server path unchanged
    two = make_transports([FakeLink(), FakeLink()], [_info(), _info()], model, _settings())
    assert isinstance(two, EveryServer) and len(two.transports) == 2
    assert all(isinstance(t, ServerRestarts) for t in two.transports)  # each server recovers on its own
    assert two.transports[0].link is not two.transports[1].link
    other_ranks = make_transports(None, [_info(), _info()], model, _settings())
    assert isinstance(other_ranks, EveryServer) and not other_ranks.pauses
    assert all(isinstance(t, OtherRank) for t in other_ranks.transports)  # one gather per server's push
