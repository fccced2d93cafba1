"""A server inside the trainer's process (`ServerThread`) keeps its CUDA graphs while the trainer's thread
synchronizes the whole device, as inductor does when it autotunes a compiled graph's first run: the
trainer's device work holds `capture_gate.device_work`, and the engine captures only in its gaps.
Without the gate a capture met by `torch.cuda.synchronize()` in another thread fails ("operation not
permitted when stream is capturing"; a 1.7B trainer on an H100) and the server falls back to eager steps.

    pytest -m gpu tests/gpu/test_capture_gate_cuda.py
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(400, method="thread")]

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "sync"))
from test_weight_sync import _tiny_qwen3


def _complete(url: str, seed: int) -> dict:
    body = json.dumps({"prompt": [1, 5, 9, 17 + seed % 7], "max_tokens": 24, "temperature": 1.0, "top_k": 20,
                       "seed": seed}).encode()
    request = urllib.request.Request(f"{url}/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.loads(response.read())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_graphs_survive_a_trainer_thread_that_synchronizes_the_device(tmp_path):
    from asyncgrpo.capture_gate import device_work
    from asyncgrpo.launch import free_port
    from asyncgrpo.server.serve import ServeConfig, ServerThread

    _tiny_qwen3(tmp_path / "tiny")
    config = ServeConfig.of(str(tmp_path / "tiny"), "--device", "cuda:0", "--port",
                            str(free_port()), "--dtype",
                            "float32", "--max-model-len", "128", "--gpu-memory-utilization", "0.3")
    stop = threading.Event()
    syncs = []

    def trainer():  # device-wide syncs back to back, as an autotuning compile makes them
        x = torch.randn(1024, 1024, device="cuda:0")
        while not stop.is_set():
            with device_work():
                for _ in range(20):
                    x = torch.tanh(x @ x)
                torch.cuda.synchronize()
                syncs.append(1)
            time.sleep(0.002)  # the gaps between micro-batches, where captures happen

    with ServerThread(config) as server:
        thread = threading.Thread(target=trainer, daemon=True)
        thread.start()
        try:
            with ThreadPoolExecutor(32) as pool:
                for concurrency in (1, 3, 6, 12, 24, 32):  # new batch buckets: new captures meet the trainer
                    answers = list(pool.map(lambda s: _complete(server.url, s), range(concurrency)))
                    assert [len(a["choices"]) for a in answers] == [1] * concurrency
        finally:
            stop.set()
            thread.join(30)
        graphs = server.server.engine.runner.graphs
        assert syncs, "the trainer thread never ran"
        assert graphs.use_graphs, "a capture failed and the server fell back to eager steps"
        assert graphs.num_captures > 0
