"""The trainer's links to several servers (train/server_link.py): they pause together around a push, a
server that fails to pause or resume is named and leaves none of the others paused, and servers of
different models are refused. Fake links run the real pause and resume code against fake clients, each
on a thread of its own as a `ServerLink` runs it on its own event loop; no request is made."""

from __future__ import annotations

import time
from dataclasses import replace

import pytest
from support.fake_links import PAUSE_S, links

from asyncgrpo.generation.server_info import ServerDevice, ServerInfo
from asyncgrpo.train.server_link import ServerLink, same_model_problem

def test_every_server_is_paused_at_once_before_the_push_and_resumed_after_it():
    group, events = links(None, None, None)
    t0 = time.perf_counter()
    with group.paused() as timings:
        assert sorted(events) == [f"pause http://s{i}:8000" for i in range(3)]
        assert all(link.held for link in group)  # their while_paused only pushes now
        events.append("push")
    assert time.perf_counter() - t0 < 3 * PAUSE_S  # the pauses ran at the same time, not one by one
    assert events[3] == "push" and sorted(events[4:]) == [f"resume http://s{i}:8000" for i in range(3)]
    assert not any(link.held for link in group)
    assert sorted(timings["pause_s"]) == [0, 1, 2] and min(timings["pause_s"].values()) >= PAUSE_S
    assert sorted(timings["resume_s"]) == [0, 1, 2] and timings["unreachable"] == {}


def test_a_server_that_fails_to_pause_is_named_and_the_others_are_resumed():
    group, events = links(None, "pause", None)
    with pytest.raises(RuntimeError) as info:
        with group.paused():
            events.append("push")
    message = str(info.value)
    assert "could not pause the inference server at http://s1:8000" in message
    assert "connection refused" in message
    assert "the 2 other server(s) paused were resumed" in message
    assert "push" not in events
    resumed = sorted(e for e in events if e.startswith("resume"))
    assert resumed == ["resume http://s0:8000", "resume http://s2:8000"]
    assert not any(link.held for link in group)


def test_a_failed_push_resumes_every_server_and_raises_the_pushs_own_error():
    group, events = links(None, None)
    with pytest.raises(ValueError, match="the push failed"):
        with group.paused():
            raise ValueError("the push failed")
    resumed = sorted(e for e in events if e.startswith("resume"))
    assert resumed == ["resume http://s0:8000", "resume http://s1:8000"]
    assert not any(link.held for link in group)


def test_a_server_that_fails_to_resume_is_named_after_the_others_resumed():
    group, events = links("resume", None)
    with pytest.raises(RuntimeError, match="could not resume the inference server at http://s0:8000"):
        with group.paused():
            pass
    assert "resume http://s1:8000" in events


def test_with_spare_unreachable_a_server_that_cannot_be_reached_is_left_out_not_an_error():
    group, events = links(None, "all", None)
    with group.paused(spare_unreachable=True) as timings:
        assert [link.held for link in group] == [True, False, True]
    assert list(timings["unreachable"]) == [1] and "connection refused" in str(timings["unreachable"][1])
    assert sorted(timings["resume_s"]) == [0, 2]  # the unreachable one is not resumed
    assert "pause http://s1:8000" not in events and "resume http://s1:8000" not in events


def test_a_server_the_push_could_not_reach_is_not_resumed():
    group, events = links(None, None)
    with group.paused(spare_unreachable=True) as timings:
        timings["unreachable"][1] = ConnectionError("the push found it gone")
    assert sorted(timings["resume_s"]) == [0] and "resume http://s1:8000" not in events


def test_when_no_server_can_be_reached_the_pause_is_an_error_even_with_spare_unreachable():
    group, _ = links("all", "all")
    with pytest.raises(RuntimeError, match="could not pause the inference server at http://s0:8000"):
        with group.paused(spare_unreachable=True):
            pass


def test_only_the_servers_named_are_paused():
    group, events = links(None, None, None)
    with group.paused([0, 2]) as timings:
        assert [link.held for link in group] == [True, False, True]
    assert sorted(timings["pause_s"]) == [0, 2] and not any("s1" in e for e in events)


def test_a_held_link_only_pushes_its_server_is_paused_and_resumed_by_the_group():
    link = ServerLink("http://127.0.0.1:9", timeout_s=5)  # nothing listens: a pause would fail
    try:
        link.held = True

        async def push():
            return {"bytes": 10, "num_chunks": 1}

        timings = link.while_paused(push)
        assert timings["pause_s"] == 0 and timings["resume_s"] == 0 and timings["bytes"] == 10
    finally:
        link.close()


def _info(**changes) -> ServerInfo:
    info = ServerInfo(
        version="0.33.0+embedded", dialect=(0, 33, 0), model_name="asyncgrpo/tiny-chat", max_model_len=256,
        dtype="float32", logprobs_mode=None, supports_generate=True, supports_sampling_mask=True,
        has_metrics=True, kv_cache_tokens=None, world_size=1,
    )
    return replace(info, **changes)


def test_servers_of_one_model_and_context_serve_one_run():
    assert same_model_problem(["http://a", "http://b"], [_info(), _info(dtype="bfloat16")]) is None


def test_servers_of_different_models_or_context_lengths_are_refused_naming_both():
    problem = same_model_problem(["http://a", "http://b"], [_info(), _info(model_name="other")])
    assert "http://a and http://b serve different models ('asyncgrpo/tiny-chat' and 'other')" in problem
    problem = same_model_problem(["http://a", "http://b", "http://c"],
                                 [_info(), _info(), _info(max_model_len=512)])
    assert "http://a and http://c have different max_model_len (256 and 512)" in problem
    assert "--max-model-len" in problem


def _device(instance_id: str | None) -> ServerDevice:
    return ServerDevice(device_type="cpu", device_uuid=None, transfer_backend="gloo", accepts_ipc=False,
                        embedded=instance_id is not None, instance_id=instance_id)


def test_one_server_listed_under_two_addresses_is_refused_naming_both():
    infos = [_info(device=_device("a1")), _info(device=_device("b2")), _info(device=_device("a1"))]
    problem = same_model_problem(["http://127.0.0.1:8000", "http://h2:8000", "http://localhost:8000"], infos)
    assert "http://127.0.0.1:8000 and http://localhost:8000 reach the same inference server" in problem
    # servers that give no instance id (vLLM) are not told apart: nothing to refuse
    assert same_model_problem(["http://a", "http://b"], [_info(device=_device(None))] * 2) is None


@pytest.mark.process
def test_a_trainer_given_one_server_twice_stops_at_start_naming_both_addresses(tmp_path, embedded_server):
    from datasets import Dataset
    from support.short_run import short_run_config

    from asyncgrpo import AsyncGRPOTrainer
    from asyncgrpo.rewards import accuracy_reward
    from asyncgrpo.tasks import arithmetic

    server = embedded_server("asyncgrpo/tiny-chat")  # only connected to: the plain shared server
    other = server.url.replace("127.0.0.1", "localhost")
    trainer = AsyncGRPOTrainer(model="asyncgrpo/tiny-chat", reward_funcs=accuracy_reward,
                               train_dataset=Dataset.from_list(arithmetic.make_dataset(8, seed=0)),
                               args=short_run_config(tmp_path, [server.url, other], max_steps=1))
    with pytest.raises(ValueError, match=f"{server.url} and {other} reach the same inference server"):
        trainer.train()
