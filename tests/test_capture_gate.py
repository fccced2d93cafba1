"""Tests for asyncgrpo.capture_gate: the engine captures a graph only while no trainer thread computes."""

from __future__ import annotations

import contextlib
import threading
import types

from asyncgrpo.capture_gate import capture_window, device_work
from asyncgrpo.server.step_graphs import StepGraphs


@contextlib.contextmanager
def _trainer_computing():
    """Another thread inside device_work() for the duration of the block."""
    entered, leave = threading.Event(), threading.Event()

    def train():
        with device_work():
            entered.set()
            leave.wait(10)

    trainer = threading.Thread(target=train)
    trainer.start()
    entered.wait(10)
    try:
        yield
    finally:
        leave.set()
        trainer.join()


def test_a_capture_window_opens_only_while_no_thread_does_device_work():
    with capture_window() as free:
        assert free
    with _trainer_computing(), capture_window() as free:
        assert not free  # the engine runs its step eagerly instead
    with capture_window() as free:
        assert free


def test_device_work_nests_in_one_thread_and_waits_for_a_capture_in_progress():
    with device_work(), device_work():  # re-entrant: no deadlock
        pass
    order = []
    capturing, release = threading.Event(), threading.Event()

    def capture():
        with capture_window() as free:
            assert free
            capturing.set()
            release.wait(10)
            order.append("capture done")

    engine = threading.Thread(target=capture)
    engine.start()
    capturing.wait(10)
    threading.Timer(0.2, release.set).start()
    with device_work():
        order.append("trainer computes")
    engine.join()
    assert order == ["capture done", "trainer computes"]


def test_a_step_of_a_new_shape_meeting_a_computing_trainer_runs_eagerly_and_is_captured_later():
    """StepGraphs._replay's own logic, on a stand-in for its buffers (CPU has no CUDA graphs)."""
    captured = []

    def capture(key, fn):
        captured.append(key)
        graphs._graphs[key] = (types.SimpleNamespace(replay=lambda: None), "graph output")
        return True

    graphs = types.SimpleNamespace(use_graphs=True, _graphs={}, _full=False,
                                   captures_deferred=0, _captured=capture)
    with _trainer_computing():
        assert StepGraphs._replay(graphs, ("forward", 8), lambda: "eager output") == "eager output"
    assert captured == [] and graphs.captures_deferred == 1 and graphs.use_graphs
    assert StepGraphs._replay(graphs, ("forward", 8), lambda: "eager output") == "graph output"
    assert captured == [("forward", 8)]
