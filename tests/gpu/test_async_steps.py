"""On the GPU, asynchronous steps (each launched before the previous one is recorded, its decode rows'
tokens read on the device, its inputs through page-locked memory) sample what synchronous steps
sample, eagerly and through captured CUDA graphs; the CPU test's requests (stop tokens, lengths,
groups, next turns).

    pytest -m gpu tests/gpu/test_async_steps.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from asyncgrpo.server.decode_kernels import triton_available

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))  # the CPU test's tiny model and requests
from test_async_scheduling import Server, _assert_same, _first_wave, _next_turns

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or not triton_available(), reason="needs CUDA and Triton"),
]


@pytest.fixture(scope="module")
def model():
    from test_async_scheduling import model as cpu_model

    return cpu_model.__wrapped__().to("cuda")


@pytest.mark.parametrize("fixed_shape", [False, True], ids=["eager", "graphs"])
def test_asynchronous_steps_on_the_gpu(model, fixed_shape):
    on = Server(model, True, fixed_shape=fixed_shape, device="cuda")
    off = Server(model, False, fixed_shape=fixed_shape, device="cuda")
    (a, _), (b, _) = on.run([_first_wave, _next_turns]), off.run([_first_wave, _next_turns])
    _assert_same(a, b)
    assert on.launches_reading_pending > 10
    if fixed_shape:
        assert on.runner.graphs.use_graphs and on.runner.graphs._graphs, "the steps replayed captured graphs"
