"""On the GPU, asynchronous steps (each launched before the previous one is recorded, its decode rows'
tokens read on the device, its inputs through page-locked memory) sample what synchronous steps
sample, eagerly and through captured CUDA graphs; the CPU test's requests (stop tokens, lengths,
groups, next turns).

    pytest -m gpu tests/gpu/test_async_steps.py
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import pytest
import torch

from asyncgrpo.server.decode_kernels import triton_available

# the CPU test's tiny model and requests
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "server"))
from test_async_scheduling import Server, _assert_same, _first_wave, _next_turns

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or not triton_available(),
                       reason="needs CUDA and Triton"),
]


@pytest.fixture(scope="module")
def model():
    from test_prefix_caching import tiny_qwen3

    return tiny_qwen3().to("cuda")


@pytest.mark.parametrize("fixed_shape", [False, True], ids=["eager", "graphs"])
def test_asynchronous_steps_on_the_gpu(model, fixed_shape):
    on = Server(model, True, fixed_shape=fixed_shape, device="cuda")
    off = Server(model, False, fixed_shape=fixed_shape, device="cuda")
    (a, _), (b, _) = on.run([_first_wave, _next_turns]), off.run([_first_wave, _next_turns])
    _assert_same(a, b)
    assert on.launches_reading_pending > 10
    if fixed_shape:
        assert on.runner.graphs.use_graphs and on.runner.graphs._graphs, "the steps replayed captured graphs"


def test_decode_steps_are_launched_without_waiting_for_the_device(model):
    """A decode step that replays captured graphs queues its inputs, replays and output copy without any
    call that waits for the device (PyTorch's sync debug mode flags them), so that it can be launched
    while the step before it runs."""
    on = Server(model, True, fixed_shape=True, device="cuda")
    graphs, launch = on.runner.graphs, on.runner.launch
    flagged = []

    def checked(decode, prefill):
        before = len(graphs._graphs)  # a capture synchronises on purpose: only replays are checked
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                out = launch(decode, prefill)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        if not prefill and len(graphs._graphs) == before:
            flagged.extend(str(w.message) for w in caught)
        return out

    on.runner.launch = checked
    on.run([_first_wave, _next_turns])
    assert on.launches_reading_pending > 10
    assert not flagged, flagged[:3]
