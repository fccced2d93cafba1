"""examples/one_gpu.py on one GPU as its users run it: the embedded server inside the trainer's process
(the recipe's CUDA default, also with the trainer's layers compiled) and in its own process, each
training the bundled tiny model for two steps on a local GSM8K-shaped file, with weights synced by
CUDA IPC after every step.

    pytest -m gpu tests/gpu/test_one_gpu_recipe_cuda.py
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600, method="thread"),
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

pytest.importorskip("math_verify", reason="the recipe's accuracy_reward needs math-verify (pip install "
                    "'asyncgrpo[math]', or its three pure-Python wheels where there is no index)")

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
from test_one_gpu_example import import_example, write_gsm8k_file


@pytest.fixture
def one_gpu(monkeypatch):
    return import_example(monkeypatch)


@pytest.mark.parametrize("where", ["in-process", "server-process", "in-process, compiled trainer"])
def test_the_recipe_trains_on_one_gpu(one_gpu, tmp_path, where):
    data = write_gsm8k_file(tmp_path / "gsm8k.jsonl")
    history = one_gpu.main(["--model", "asyncgrpo/tiny-chat", "--data-files", str(data), "--instruction", "",
                            "--device", "cuda", "--gpu-memory-utilization", "0.2",
                            "--max-steps", "2", "--num-generations", "4", "--max-completion-length", "48",
                            "--token-budget", "512", "--grad-accum", "1", "--max-model-len", "256",
                            "--output-dir", str(tmp_path / "out"),
                            *(["--server-process"] if where == "server-process" else []),
                            *(["--torch-compile"] if "compiled" in where else [])])
    steps = [e for e in history if "perf/step_s" in e]
    assert len(steps) == 2
    assert all(e["perf/weight_sync_s"] > 0 for e in steps)  # a sync after every step (CUDA IPC on one GPU)
    assert (tmp_path / "out" / "model.safetensors").exists()
