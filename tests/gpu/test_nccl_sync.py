"""NCCL weight transfer on real GPUs (needs 2 CUDA devices: NCCL refuses two ranks on one GPU).

The receiver side runs in a subprocess: a minimal aiohttp server with the weight routes around a real
`WeightReceiver` on cuda:1 (this file run as a script). The test process is the trainer: a
`WeightSender` on cuda:0 going through the UID handshake of vllm-protocol.md 5.2.

    pytest -m gpu tests/gpu/test_nccl_sync.py
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import socket
import subprocess
import sys

import pytest
import torch

# a hung NCCL call cannot take a signal
pytestmark = [pytest.mark.gpu, pytest.mark.timeout(240, method="thread")]

needs_two_gpus = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 CUDA devices"
)


def digest(tensor: torch.Tensor) -> str:
    data = tensor.detach().contiguous().reshape(-1).view(torch.uint8).cpu().numpy().tobytes()
    return f"{tensor.dtype}:{list(tensor.shape)}:{hashlib.sha256(data).hexdigest()}"


def serve_receiver(port: int, device: str) -> None:
    """The server side (subprocess): weight routes around a WeightReceiver; GET /digests returns
    what the last update delivered."""
    from aiohttp import web

    from asyncgrpo.sync.receiver import WeightReceiver

    receiver = WeightReceiver(device=torch.device(device), timeout_s=60)
    state: dict = {"digests": [], "version": None}

    def error(exc: Exception) -> web.Response:
        return web.json_response(
            {"error": {"message": str(exc), "type": type(exc).__name__, "code": 500}}, status=500
        )

    async def world(request):
        return web.json_response({"world_size": 1})

    async def version(request):
        return web.json_response({"version": "0.33.0+test"})

    async def health(request):
        return web.Response()

    async def models(request):
        return web.json_response(
            {"object": "list", "data": [{"id": "test", "parent": None, "max_model_len": 16}]}
        )

    async def init(request):
        body = await request.json()
        try:
            await asyncio.to_thread(receiver.init, body["init_info"])
        except (ValueError, RuntimeError) as exc:
            return error(exc)
        return web.json_response({"message": "Weight transfer initialized"})

    async def start(request):
        return web.json_response({"message": "Weight update started"})

    async def update(request):
        body = await request.json()

        def run():
            out = []
            for name, tensor in receiver.receive(body["update_info"]):
                assert tensor.device == torch.device(device)
                out.append([name, digest(tensor)])
            return out

        try:
            state["digests"] = await asyncio.to_thread(run)
        except (ValueError, RuntimeError) as exc:
            return error(exc)
        return web.json_response({"message": "Weights updated"})

    async def finish(request):
        state["version"] = (await request.json()).get("weight_version")
        return web.json_response({"message": "Weight update finished"})

    async def digests(request):
        return web.json_response(state)

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_get("/version", version)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/get_world_size", world)
    app.router.add_post("/init_weight_transfer_engine", init)
    app.router.add_post("/start_weight_update", start)
    app.router.add_post("/update_weights", update)
    app.router.add_post("/finish_weight_update", finish)
    app.router.add_get("/digests", digests)
    web.run_app(app, host="127.0.0.1", port=port, print=None)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tensors(seed: int, device: str) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator(device=device).manual_seed(seed)
    return [
        ("model.embed_tokens.weight", torch.randn(1000, 256, generator=g, device=device).to(torch.bfloat16)),
        (
            "model.layers.0.self_attn.q_proj.weight",
            torch.randn(256, 256, generator=g, device=device).to(torch.bfloat16),
        ),
        ("model.norm.weight", torch.randn(256, generator=g, device=device)),
        ("scalar", torch.tensor(float(seed), device=device)),
        ("empty", torch.empty(0, 8, dtype=torch.float16, device=device)),
        ("fp8", torch.randn(64, generator=g, device=device).to(torch.float8_e4m3fn)),
        ("lm_head.weight", torch.randn(1000, 256, generator=g, device=device).to(torch.bfloat16)),
    ]


@needs_two_gpus
@pytest.mark.parametrize("packed,buffer_size", [(True, 1 << 30), (True, 100_000), (False, 1 << 30)])
def test_nccl_push_to_a_receiver_on_another_gpu(packed, buffer_size):
    from aiohttp import ClientSession

    from asyncgrpo.generation.client import GenerationClient
    from asyncgrpo.sync.sender import WeightSender

    port = _free_port()
    env = {**os.environ, "NCCL_NVLS_ENABLE": "0"}
    proc = subprocess.Popen([sys.executable, __file__, str(port), "cuda:1"], env=env)
    url = f"http://127.0.0.1:{port}"
    sent = [_tensors(1, "cuda:0"), _tensors(2, "cuda:0")]

    async def main():
        async with GenerationClient(url, timeout_s=60) as client:
            await client.wait_until_ready(60)
            info = await client.detect()
            assert info.world_size == 1 and not info.supports_generate
            sender = WeightSender(
                client,
                backend="nccl",
                device=torch.device("cuda:0"),
                packed=packed,
                buffer_size_bytes=buffer_size,
                timeout_s=60,
            )
            await sender.init()
            results = []
            try:
                for i, tensors in enumerate(sent):
                    stats = await sender.push(tensors, version=f"step-{i + 1}")
                    async with ClientSession() as s, s.get(url + "/digests") as r:
                        results.append((stats, await r.json()))
            finally:
                await sender.close()
            return results

    try:
        results = asyncio.run(main())
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    for i, (tensors, (stats, state)) in enumerate(zip(sent, results)):
        assert state["version"] == f"step-{i + 1}"
        assert state["digests"] == [[name, digest(t)] for name, t in tensors]
        assert stats["bytes"] == sum(t.numel() * t.element_size() for _, t in tensors)


@needs_two_gpus
def test_nccl_communicator_collectives():
    """Two ranks in two processes: the warm-up all-reduce and a broadcast give the right values."""
    import multiprocessing as mp

    from asyncgrpo.sync.nccl import get_unique_id

    uid = get_unique_id()
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_collective_rank, args=(uid, rank, queue)) for rank in (0, 1)]
    for p in procs:
        p.start()
    results = dict(queue.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(timeout=30)
    assert results == {0: (3.0, list(range(10))), 1: (3.0, list(range(10)))}


def _collective_rank(uid: bytes, rank: int, queue) -> None:
    from asyncgrpo.sync.nccl import NcclCommunicator

    device = torch.device("cuda", rank)
    comm = NcclCommunicator(uid, rank=rank, world_size=2, device=device, timeout_s=60)
    x = torch.full((1,), float(rank + 1), device=device)
    comm.all_reduce_sum_(x)
    y = (
        torch.arange(10, dtype=torch.int64, device=device)
        if rank == 0
        else torch.zeros(10, dtype=torch.int64, device=device)
    )
    comm.broadcast_(y, 0)
    comm.synchronize()
    queue.put((rank, (x.item(), y.tolist())))
    comm.close()


if __name__ == "__main__":
    serve_receiver(int(sys.argv[1]), sys.argv[2])
