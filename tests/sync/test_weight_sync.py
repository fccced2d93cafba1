"""Weight transfer over gloo through the real HTTP handshake.

1. `WeightSender` -> a minimal aiohttp peer hosting a real `WeightReceiver` (same process, the
   receiver in a worker thread): layout, packed and unpacked, chunking, errors.
2. `WeightSender` -> `asyncgrpo serve` (the embedded server, CPU, subprocess) with a random tiny
   Qwen3: after a push, the server's processed log-probs equal those of the changed model computed
   here; a bad payload is a clear error and the server keeps serving.
"""

from __future__ import annotations

import asyncio
import math
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from aiohttp import web

from asyncgrpo.generation.client import GenerationClient
from asyncgrpo.generation.protocol import SamplingParams
from asyncgrpo.sync.receiver import WeightReceiver
from asyncgrpo.sync.sender import WeightSender, WeightTransferError

pytestmark = pytest.mark.process

# --------------------------------------------------------------------------------------------------
# 1. sender <-> receiver through a minimal HTTP peer
# --------------------------------------------------------------------------------------------------


def receiver_app(received: list, *, world_size: int = 1) -> web.Application:
    """The weight routes of a server with one worker, around a real WeightReceiver."""
    receiver = WeightReceiver(device=torch.device("cpu"), timeout_s=20)

    def error(exc: Exception) -> web.Response:
        return web.json_response(
            {"error": {"message": str(exc), "type": type(exc).__name__, "code": 500}}, status=500
        )

    async def world(request):
        return web.json_response({"world_size": world_size})

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
            return [(name, tensor.clone()) for name, tensor in receiver.receive(body["update_info"])]

        try:
            received.append(await asyncio.to_thread(run))
        except (ValueError, RuntimeError) as exc:
            return error(exc)
        return web.json_response({"message": "Weights updated"})

    async def finish(request):
        body = await request.json() if request.can_read_body else {}
        received.append(("version", body.get("weight_version")))
        return web.json_response({"message": "Weight update finished"})

    app = web.Application()
    app.router.add_get("/get_world_size", world)
    app.router.add_post("/init_weight_transfer_engine", init)
    app.router.add_post("/start_weight_update", start)
    app.router.add_post("/update_weights", update)
    app.router.add_post("/finish_weight_update", finish)
    app.on_cleanup.append(lambda app: asyncio.to_thread(receiver.shutdown))
    return app


async def with_peer(body, **sender_kw):
    received: list = []
    runner = web.AppRunner(receiver_app(received))
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    host, port = runner.addresses[0][:2]
    client = GenerationClient(f"http://{host}:{port}", timeout_s=20)
    await client.start()
    sender = WeightSender(client, backend="gloo", device=torch.device("cpu"), timeout_s=20, **sender_kw)
    try:
        await sender.init()
        return await body(sender), received
    finally:
        await sender.close()
        await client.close()
        await runner.cleanup()


def mixed_tensors(seed: int) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [
        ("model.embed_tokens.weight", torch.randn(64, 16, generator=g).to(torch.bfloat16)),
        ("model.norm.weight", torch.randn(16, generator=g)),
        ("step", torch.tensor(seed, dtype=torch.int64)),
        ("empty", torch.empty(0, 3, dtype=torch.float16)),
        ("flags", torch.randint(0, 2, (5,), dtype=torch.uint8, generator=g)),
        ("lm_head.weight", torch.randn(64, 16, generator=g).to(torch.bfloat16)),
    ]


@pytest.mark.parametrize("packed,buffer_size", [(True, 1 << 30), (True, 1000), (True, 1), (False, 1 << 30)])
def test_push_round_trip_over_gloo(packed, buffer_size):
    first, second = mixed_tensors(1), mixed_tensors(2)

    async def body(sender):
        s1 = await sender.push(first, version="step-1")
        # lazily produced tensors with metadata up front (as FSDP gathering would do)
        from asyncgrpo.sync.packed import TensorMeta

        metas = [TensorMeta.of(n, t) for n, t in second]
        s2 = await sender.push((pair for pair in second), version="step-2", metas=metas)
        return s1, s2

    (s1, s2), received = asyncio.run(with_peer(body, packed=packed, buffer_size_bytes=buffer_size))
    assert [r for r in received if r[0] == "version"] == [("version", "step-1"), ("version", "step-2")]
    updates = [r for r in received if r[0] != "version"]
    for sent, got in zip((first, second), updates):
        assert [n for n, _ in got] == [n for n, _ in sent]
        for (name, a), (_, b) in zip(sent, got):
            assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), name
    nbytes = sum(t.numel() * t.element_size() for _, t in first)
    assert s1["bytes"] == nbytes and s1["num_tensors"] == len(first)
    assert s1["num_chunks"] == (len(first) if not packed else {1 << 30: 1, 1000: 2, 1: 5}[buffer_size])
    assert s2["num_chunks"] == s1["num_chunks"] and s2["bytes"] == s1["bytes"]


def test_rejected_update_raises_before_sending_and_the_group_stays_usable():
    good = mixed_tensors(3)

    async def body(sender):
        bad = [
            ("model.norm.weight", torch.randn(16)),
            ("model.norm.weight", torch.randn(16)),
        ]  # duplicate names
        with pytest.raises(WeightTransferError, match="names must be unique"):
            await sender.push(bad, version="bad")
        return await sender.push(good, version="good")

    stats, received = asyncio.run(with_peer(body))
    assert stats["num_tensors"] == len(good)
    got = [r for r in received if r[0] != "version"][-1]
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(good, got))


def test_tensor_iterator_that_breaks_its_promise_fails_the_push():
    tensors = mixed_tensors(4)

    async def body(sender):
        from asyncgrpo.sync.packed import TensorMeta

        metas = [TensorMeta.of(n, t) for n, t in tensors]
        with pytest.raises(ValueError, match="ended before"):
            await sender.push(iter(tensors[:2]), version="v", metas=metas)
        with pytest.raises(WeightTransferError, match="out of step"):
            await sender.push(tensors, version="v2")

    asyncio.run(with_peer(body, buffer_size_bytes=1))


def test_receiver_validates_init_info_before_joining():
    r = WeightReceiver(device=torch.device("cpu"), timeout_s=5)
    with pytest.raises(ValueError, match="Invalid init_info: .*master_address"):
        r.init({"backend": "gloo", "master_port": 1, "rank_offset": 1, "world_size": 2})
    with pytest.raises(RuntimeError, match="not initialised"):
        r.receive({"names": [], "dtype_names": [], "shapes": []})


# --------------------------------------------------------------------------------------------------
# 2. the embedded server
# --------------------------------------------------------------------------------------------------


def _embedded_server_available() -> bool:
    return (Path(__file__).resolve().parents[2] / "src" / "asyncgrpo" / "server" / "app.py").exists()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tiny_qwen3(path: Path):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(config).eval()
    model.save_pretrained(path)
    return model


def _processed_logprobs(model, prompt: list[int], tokens: list[int], top_k: int) -> list[float]:
    """Log-probs of `tokens` under `model` after top-k truncation at temperature 1 (the sampled
    distribution), computed in one forward pass here."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1].float()
    kth = logits.topk(top_k, dim=-1).values[:, -1:]
    logits = logits.masked_fill(logits < kth, -math.inf)
    logp = torch.log_softmax(logits, dim=-1)
    return [logp[i, t].item() for i, t in enumerate(tokens)]


@pytest.fixture(scope="module")
def embedded_server(tmp_path_factory):
    if not _embedded_server_available():
        pytest.skip("the embedded server (asyncgrpo.server.app) is not part of this checkout yet")
    model_dir = tmp_path_factory.mktemp("tiny_qwen3")
    model = _tiny_qwen3(model_dir)
    port = _free_port()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "CUDA_VISIBLE_DEVICES": ""}
    log = (model_dir / "server.log").open("w")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "asyncgrpo.cli",
            "serve",
            str(model_dir),
            "--port",
            str(port),
            "--dtype",
            "float32",
            "--max-model-len",
            "128",
        ],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        yield model, f"http://127.0.0.1:{port}", proc
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def test_push_into_the_embedded_server_changes_generation_exactly(embedded_server):
    model, url, proc = embedded_server
    prompt = [1, 5, 9, 17, 33]
    params = SamplingParams(temperature=1.0, top_k=8, max_tokens=6, seed=1234, logprobs=0)

    async def main():
        async with GenerationClient(url, timeout_s=60) as client:
            try:
                await client.wait_until_ready(120)
            except TimeoutError:
                raise AssertionError(f"server did not start; exit code {proc.poll()}") from None
            await client.detect()
            before = await client.generate(prompt, params)
            before_expected = _processed_logprobs(model, prompt, before.token_ids, top_k=8)
            sender = WeightSender(
                client, backend="gloo", device=torch.device("cpu"), timeout_s=60, buffer_size_bytes=4096
            )
            await sender.init()
            try:
                # the new policy: every weight perturbed (a seeded, visible change)
                g = torch.Generator().manual_seed(7)
                with torch.no_grad():
                    for p in model.parameters():
                        p.add_(0.5 * torch.randn(p.shape, generator=g))
                named = [(n, p.detach().clone()) for n, p in model.state_dict().items()]
                await client.pause(mode="keep")
                stats = await sender.push(named, version="step-1")
                await client.resume()
                version = await client.weight_info()
                after = await client.generate(prompt, params)

                # a bad payload: a name the model does not have -> clear error, server still serves
                await client.pause(mode="keep")
                with pytest.raises(WeightTransferError, match="no_such_param|unknown"):
                    await sender.push([("model.no_such_param", torch.zeros(3))], version="bad")
                await client.resume()
                still = await client.generate(prompt, params)

                # the next sync after the failure goes through
                step1_logprobs = _processed_logprobs(model, prompt, after.token_ids, top_k=8)
                with torch.no_grad():
                    for p in model.parameters():
                        p.mul_(-1.0)
                await client.pause(mode="keep")
                await sender.push(
                    [(n, p.detach().clone()) for n, p in model.state_dict().items()], version="step-2"
                )
                await client.resume()
                version2 = await client.weight_info()
                after2 = await client.generate(prompt, params)
            finally:
                await sender.close()
            return before, before_expected, after, still, after2, stats, version, version2, step1_logprobs

    before, before_expected, after, still, after2, stats, version, version2, step1_logprobs = asyncio.run(
        main()
    )
    assert (version, version2) == ("step-1", "step-2")
    assert stats["num_chunks"] > 1
    assert after.logprobs == pytest.approx(step1_logprobs, abs=1e-4)
    assert before.logprobs == pytest.approx(before_expected, abs=1e-4)  # the reference matches the server
    assert after.token_ids != before.token_ids or after.logprobs != pytest.approx(before.logprobs, abs=1e-3)
    # the rejected payload changed nothing: same seed, same weights, same tokens and log-probs
    assert still.token_ids == after.token_ids and still.logprobs == pytest.approx(after.logprobs, abs=1e-6)
    assert after2.logprobs == pytest.approx(
        _processed_logprobs(model, prompt, after2.token_ids, top_k=8), abs=1e-4
    )
    assert after2.weight_versions[0].version == "step-2"


def test_weight_checksum_route_matches_the_pushed_weights(embedded_server):
    from asyncgrpo.sync.checksum import checksum_mismatches, tensor_digest, weights_checksum

    model, url, _ = embedded_server
    g = torch.Generator().manual_seed(11)
    named = [(n, p.detach() + 0.1 * torch.randn(p.shape, generator=g)) for n, p in model.named_parameters()]

    async def main():
        async with GenerationClient(url, timeout_s=60) as client:
            await client.wait_until_ready(120)
            await client.detect()
            sender = WeightSender(client, backend="gloo", device=torch.device("cpu"), timeout_s=60)
            await sender.init()
            try:
                await client.pause(mode="keep")
                await sender.push(named, version="checksum")
                await client.resume()
                return await client.weight_checksum()
            finally:
                await sender.close()

    served = asyncio.run(main())
    expected = weights_checksum(named)
    assert set(served) >= set(expected) and checksum_mismatches(expected, served) == []
    name, tensor = named[0]
    assert served[name] == tensor_digest(tensor.clone()) != tensor_digest(tensor.nextafter(tensor + 1))
    assert served[name].startswith(f"float32:{list(tensor.shape)}:")
