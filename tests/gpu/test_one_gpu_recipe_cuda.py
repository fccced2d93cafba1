"""examples/one_gpu.py on one GPU as its users run it: the embedded server inside the trainer's process
(the recipe's CUDA default) and in its own process, each training the bundled tiny model for two
steps on a local GSM8K-shaped file, with weights synced by CUDA IPC after every step.

    pytest -m gpu tests/gpu/test_one_gpu_recipe_cuda.py
"""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

import pytest
import torch

from asyncgrpo.tasks import arithmetic

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600, method="thread"),
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@pytest.fixture
def one_gpu(monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLES))
    monkeypatch.delitem(sys.modules, "one_gpu", raising=False)  # bench/one_gpu.py has the same module name
    return importlib.import_module("one_gpu")


@pytest.mark.parametrize("where", ["in-process", "server-process"])
def test_the_recipe_trains_on_one_gpu(one_gpu, tmp_path, where):
    data = tmp_path / "gsm8k.jsonl"
    with data.open("w") as f:
        for row in arithmetic.make_dataset(64, seed=0):
            f.write(json.dumps({"question": row["prompt"][-1]["content"],
                                "answer": f"{row['solution']}\n#### {row['answer']}"}) + "\n")
    history = one_gpu.main(["--model", "asyncgrpo/tiny-chat", "--data-files", str(data), "--instruction", "",
                            "--device", "cuda", "--gpu-memory-utilization", "0.2",
                            "--max-steps", "2", "--num-generations", "4", "--max-completion-length", "48",
                            "--token-budget", "512", "--grad-accum", "1", "--max-model-len", "256",
                            "--output-dir", str(tmp_path / "out"),
                            *(["--server-process"] if where == "server-process" else [])])
    steps = [e for e in history if "perf/step_s" in e]
    assert len(steps) == 2
    assert all(e["perf/weight_sync_s"] > 0 for e in steps)  # a sync after every step (CUDA IPC on one GPU)
    assert (tmp_path / "out" / "model.safetensors").exists()
