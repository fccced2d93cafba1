"""The weight push to several servers (train/weights/every_server.py, `choose.make_transports`) without a
server: one transport per server, all servers paused around the pushes, the timings of the whole sync and
of each server. Fake transports note their calls; fake links (tests/support/fake_links.py) pause."""

from __future__ import annotations

import pytest
import torch
from support.fake_links import links
from test_weight_transports import FakeLink, _info, _settings

from asyncgrpo.generation.transport import ServerConnectionError
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
        if self.fails == "gone":
            raise ServerConnectionError(f"POST http://{self.name}/update_weights failed: connection refused")
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
    timings = every_server_timings({0: part, 2: {**part, "transfer_s": 0.5, "total_s": 0.5}},
                                   pause_s={0: 0.1, 2: 0.3}, resume_s={0: 0.2, 2: 0.05}, total_s=2.6)
    assert timings == pytest.approx({
        "total_s": 2.6, "pause_s": 0.3, "resume_s": 0.2, "transfer_s": 2.0, "bytes": 20.0, "num_chunks": 4.0,
        "total_s/0": 1.8, "total_s/2": 0.85,  # by server index: server 1 was not pushed
    })
    assert every_server_timings({0: {}, 1: {}}, pause_s={}, resume_s={}, total_s=0.1) == {}  # other ranks
    flagged = every_server_timings({0: {**part, "delta": 1.0}, 1: {**part, "delta": 0.0}}, pause_s={},
                                   resume_s={}, total_s=3.0)
    assert flagged["delta"] == 0.5 and flagged["bytes"] == 20.0  # a flag is averaged, a size added up


def test_one_server_gets_its_transport_alone_several_get_one_each_behind_every_server():
    model = torch.nn.Linear(2, 2)
    one = make_transports([FakeLink()], [_info()], model, _settings())
    assert isinstance(one, ServerRestarts)  # as make_transport gives it: the single-server path unchanged
    two = make_transports([FakeLink(), FakeLink()], [_info(), _info()], model, _settings())
    assert isinstance(two, EveryServer) and len(two.transports) == 2 and two.failover
    assert all(isinstance(t, ServerRestarts) for t in two.transports)  # each server recovers on its own
    assert two.transports[0].link is not two.transports[1].link
    other_ranks = make_transports(None, [_info(), _info()], model, _settings())
    assert isinstance(other_ranks, EveryServer) and not other_ranks.pauses
    several_processes = make_transports([FakeLink(), FakeLink()], [_info(), _info()], model, _settings(2))
    assert not several_processes.failover  # every rank must push to the same servers
    assert all(isinstance(t, OtherRank) for t in other_ranks.transports)  # one gather per server's push


# -- a server that stops answering -------------------------------------------------------------------


def test_a_server_that_stops_answering_is_left_out_with_a_warning_and_the_sync_goes_on(caplog):
    group, events = links(None, None, None)
    transports = [Noting(f"t{i}", events, link) for i, link in enumerate(group)]
    weights = EveryServer(transports, group, failover=True)
    transports[1].fails = "gone"  # its push finds it gone
    with caplog.at_level("WARNING", logger="asyncgrpo.train.weights.every_server"):
        timings = weights.push(torch.nn.Linear(1, 1), WeightVersion(1))
    assert weights.out == {1} and "resume http://s1:8000" not in events
    assert "the inference server at http://s1:8000 does not answer" in caplog.text
    assert "training goes on with the other 2 server(s)" in caplog.text
    assert "total_s/1" not in timings and {"total_s/0", "total_s/2"} <= set(timings)
    group.links[1].client.fails = "all"  # dead: the next sync leaves it alone
    events.clear()
    weights.push(torch.nn.Linear(1, 1), WeightVersion(2))
    assert [e for e in events if "s1" in e or "t1" in e] == []


def test_a_server_that_cannot_be_paused_is_left_out_the_others_are_pushed():
    group, events = links(None, "all")
    transports = [Noting(f"t{i}", events, link) for i, link in enumerate(group)]
    weights = EveryServer(transports, group, failover=True)
    weights.push(torch.nn.Linear(1, 1), WeightVersion(1))
    assert weights.out == {1} and [e for e in events if e.startswith("push")] == ["push t0 v1 held"]


def test_the_last_server_that_answers_is_never_left_out():
    group, events = links(None, None)
    transports = [Noting(f"t{i}", events, link) for i, link in enumerate(group)]
    weights = EveryServer(transports, group, failover=True)
    transports[1].fails = "gone"
    weights.push(torch.nn.Linear(1, 1), WeightVersion(1))
    transports[0].fails = "gone"
    with pytest.raises(ServerConnectionError):  # stops the run, as with one server
        weights.push(torch.nn.Linear(1, 1), WeightVersion(2))


def test_without_failover_a_server_that_stops_answering_stops_the_sync():
    group, events = links(None, "all")
    weights = EveryServer([Noting(f"t{i}", events, link) for i, link in enumerate(group)], group)
    with pytest.raises(RuntimeError, match="could not pause the inference server at http://s1:8000"):
        weights.push(torch.nn.Linear(1, 1), WeightVersion(1))


def test_a_server_that_answers_again_gets_the_transfer_and_the_weights_before_it_is_back(caplog, monkeypatch):
    monkeypatch.setattr("asyncgrpo.train.weights.every_server.REJOIN_EVERY_S", 0.0)
    group, events = links(None, None)
    transports = [Noting(f"t{i}", events, link) for i, link in enumerate(group)]
    weights = EveryServer(transports, group, failover=True)
    group.links[1].client.fails = "all"
    weights.push(torch.nn.Linear(1, 1), WeightVersion(1))
    assert weights.out == {1}
    events.clear()
    weights.idle(None, WeightVersion(1))  # still dead: nothing happens to it
    assert events == ["idle t0"] and weights.out == {1}
    group.links[1].client.fails, transports[1].fails = None, False  # back (a supervisor restarted it)
    events.clear()
    with caplog.at_level("WARNING", logger="asyncgrpo.train.weights.every_server"):
        weights.idle(None, WeightVersion(1))
    assert events == ["idle t0", "close t1", "init t1", "push t1 v1"]  # not held: it is paused alone
    assert weights.out == set()
    assert "http://s1:8000 answers again and serves the trainer's weights (v1)" in caplog.text
    events.clear()
    weights.push(torch.nn.Linear(1, 1), WeightVersion(2))
    assert [e for e in events if e.startswith("push")] == ["push t0 v2 held", "push t1 v2 held"]
