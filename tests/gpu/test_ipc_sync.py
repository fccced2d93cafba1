"""CUDA IPC weight sync into the embedded server on the trainer's own GPU (one GPU is enough).

The server runs as `asyncgrpo serve --device cuda:0` in a subprocess; this process is the trainer on
cuda:0. The transport is chosen as the trainer chooses it (equal GPU UUIDs -> "ipc"), the weights
are pushed with JSON handles, and the server's /weight_checksum must equal the trainer's weights.

    pytest -m gpu tests/gpu/test_ipc_sync.py
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(240, method="thread")]

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(scope="module")
def gpu_server(tmp_path_factory):
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "integration"))
    from test_weight_sync import _tiny_qwen3

    from asyncgrpo.launch import EmbeddedServer

    model_dir = tmp_path_factory.mktemp("tiny_qwen3_gpu")
    model = _tiny_qwen3(model_dir)
    args = ["--dtype", "float32", "--max-model-len", "128", "--gpu-memory-utilization", "0.3"]
    with EmbeddedServer(str(model_dir), device="cuda:0", extra_args=args, log_path=model_dir / "server.log") as server:
        yield model, server.url


@needs_gpu
def test_ipc_sync_makes_the_server_weights_equal_the_trainers(gpu_server):
    from asyncgrpo.sync.checksum import checksum_mismatches, weights_checksum
    from asyncgrpo.sync.packed import TensorMeta
    from asyncgrpo.train.server_link import ServerLink
    from asyncgrpo.train.weight_push import IpcTransport, make_transport

    model, url = gpu_server
    device = torch.device("cuda:0")
    g = torch.Generator().manual_seed(5)
    link = ServerLink(url, timeout_s=120)
    try:
        info = link.connect()
        transport = make_transport(link, device, info.device)
        assert isinstance(transport, IpcTransport) and transport.sender.dialect == "embedded"
        transport.init()
        for version in ("ipc-1", "ipc-2"):  # the second push reuses the shared buffer
            named = [(n, (p.detach() + 0.1 * torch.randn(p.shape, generator=g)).to(device))
                     for n, p in model.named_parameters()]
            timings = transport.push(iter(named), version=version, metas=[TensorMeta.of(n, t) for n, t in named])
            served = link.run(link.client.weight_checksum())
            expected = weights_checksum([(n, t.cpu()) for n, t in named])
            assert checksum_mismatches(expected, served) == []
            assert timings["bytes"] == sum(t.numel() * t.element_size() for _, t in named)
        transport.close()
    finally:
        link.close()
