"""CUDA IPC weight sync into the embedded server on the trainer's own GPU (one GPU is enough).

The server runs as `asyncgrpo serve --device cuda:0` in a subprocess, or inside this process
(`ServerThread`); this process is the trainer on cuda:0. The transport is chosen as the trainer
chooses it (equal GPU UUIDs -> "ipc"), the weights are pushed with JSON handles, and after each push:
  - the server's /weight_checksum equals the trainer's weights (every byte of every parameter),
  - the server reports the pushed version,
  - the server samples from the pushed weights (its log-probs equal the pushed model's, computed
    here), which also covers the fused layers that serve views of the parameters.
The second push goes through a small buffer, so several chunks pass through the one shared buffer
(what a 1.7B model's 3.4 GB does with the 1 GiB default): the trainer overwrites it for chunk k+1
only after the server answered that it copied chunk k.

    pytest -m gpu tests/gpu/test_ipc_sync.py
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(400, method="thread")]

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "sync"))
from test_weight_sync import _processed_logprobs, _tiny_qwen3

PROMPT = [1, 5, 9, 17, 33]


@pytest.fixture(scope="module", params=["own-process", "in-process"])
def gpu_server(request, tmp_path_factory):
    """The server as its own process, or inside this one (`ServerThread`: the trainer's buffer is read
    directly, CUDA cannot open a handle in the process that made it); (model, url, the `ServerThread`
    or None)."""
    from asyncgrpo.launch import EmbeddedServer, free_port
    from asyncgrpo.server.serve import ServeConfig, ServerThread

    model_dir = tmp_path_factory.mktemp("tiny_qwen3_gpu")
    model = _tiny_qwen3(model_dir)
    args = ["--dtype", "float32", "--max-model-len", "128", "--gpu-memory-utilization", "0.3"]
    # a cold start compiles the Triton kernels and captures the CUDA graphs: allow minutes
    if request.param == "in-process":
        server = ServerThread(
            ServeConfig.of(str(model_dir), "--device", "cuda:0", "--port", str(free_port()), *args)
        )
        with server:
            yield model, server.url, server
        return
    with EmbeddedServer(str(model_dir), device="cuda:0", extra_args=args, log_path=model_dir / "server.log",
                        startup_timeout_s=300) as server:
        yield model, server.url, None


def _perturb_(model: torch.nn.Module, seed: int) -> list[tuple[str, torch.Tensor]]:
    """Move every parameter by a seeded step (in place); returns the new weights, on CPU."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.5 * torch.randn(p.shape, generator=g))
    return [(n, p.detach().clone()) for n, p in model.named_parameters()]


@needs_gpu
def test_ipc_sync_makes_the_server_serve_exactly_the_trainers_weights(gpu_server):
    from asyncgrpo.generation.protocol import SamplingParams
    from asyncgrpo.sync.checksum import checksum_mismatches, weights_checksum
    from asyncgrpo.sync.packed import TensorMeta
    from asyncgrpo.train.server_link import ServerLink
    from asyncgrpo.train.serving import serving_dtype
    from asyncgrpo.train.weights.choose import full_weight_transport
    from asyncgrpo.train.weights.ipc import IpcTransport

    model, url, _ = gpu_server
    device = torch.device("cuda:0")
    params = SamplingParams(temperature=1.0, top_k=8, max_tokens=6, seed=1234, logprobs=0)
    link = ServerLink(url, timeout_s=120)
    try:
        info = link.connect()
        transport = full_weight_transport(link, device, serving_dtype(info), info.device)
        assert isinstance(transport, IpcTransport) and transport.sender.dialect == "embedded"
        transport.init()
        original = link.run(link.client.generate(PROMPT, params))
        for version, seed, buffer_bytes in (("ipc-1", 1, None), ("ipc-2", 2, 4096)):
            if buffer_bytes is not None:
                transport.sender.buffer_size_bytes = buffer_bytes  # several chunks through one buffer
            named = _perturb_(model, seed)
            on_gpu = [(n, t.to(device)) for n, t in named]
            timings = transport.send(
                iter(on_gpu), label=version, metas=[TensorMeta.of(n, t) for n, t in on_gpu]
            )

            served = link.run(link.client.weight_checksum())
            assert checksum_mismatches(weights_checksum(named), served) == []
            assert link.run(link.client.weight_info()) == version
            assert timings["bytes"] == sum(t.numel() * t.element_size() for _, t in named)
            assert (timings["num_chunks"] > 1) == (buffer_bytes is not None)

            after = link.run(link.client.generate(PROMPT, params))
            assert after.logprobs == pytest.approx(
                _processed_logprobs(model, PROMPT, after.token_ids, top_k=8), abs=2e-3
            )
            assert after.token_ids != original.token_ids or after.logprobs != pytest.approx(
                original.logprobs, abs=1e-2
            )
        transport.close()
    finally:
        link.close()


@needs_gpu
def test_the_in_process_engine_steps_on_a_stream_of_the_highest_priority(gpu_server):
    """Its decode steps' kernels go before the trainer's (default-stream) blocks waiting for the GPU, and so
    do those of the CUDA graphs it replays: a graph's kernels keep the priority of the stream that captured
    them, whatever stream replays them."""
    from asyncgrpo.server.step_graphs import HIGHEST_PRIORITY

    thread = gpu_server[2]
    if thread is None:
        pytest.skip("the server runs in its own process")
    highest = torch.cuda.Stream(priority=HIGHEST_PRIORITY).priority
    assert thread.stream.priority == highest < torch.cuda.current_stream().priority
    graphs = thread.server.engine.runner.graphs
    assert graphs is not None and graphs.num_captures > 0  # the start-up warm-up captured some
    assert graphs._capture_stream.priority == highest
