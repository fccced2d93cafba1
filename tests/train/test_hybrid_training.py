"""A tiny random Qwen3.5 vision-language checkpoint (Gated DeltaNet hybrid text model) trains against
the embedded server on CPU: finite loss, the text model's weights synced to the server after every
step, and the server's log-probs equal the trainer's at step 0 and after the last sync."""

from __future__ import annotations

import asyncio
import json
import math
import os
import sys
import urllib.request
from pathlib import Path

import pytest
import torch

# the checkpoint of tests/server/test_hybrid_server.py
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "server"))
from test_hybrid_server import save_hybrid_vision_language
from transformers import AutoModelForImageTextToText

from asyncgrpo import AsyncGRPOConfig, AsyncGRPOTrainer
from asyncgrpo.generation.client import GenerationClient
from asyncgrpo.launch import EmbeddedServer
from asyncgrpo.sync.checksum import checksum_mismatches, weights_checksum
from asyncgrpo.train.weights.gather import weights_for_server

pytestmark = pytest.mark.process

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def text_length_reward(completions, **kwargs) -> list[float]:
    """A reward with variance for a random model's output: its length modulo 3."""
    return [float(len(str(c[-1]["content"])) % 3) for c in completions]


async def served_checksum(url: str) -> dict[str, str]:
    async with GenerationClient(url, timeout_s=60) as client:
        return await client.weight_checksum()


def served_logprobs(url: str, prompt: list[int], max_tokens: int) -> tuple[list[int], list[float]]:
    body = {"token_ids": prompt, "sampling_params": {"max_tokens": max_tokens, "temperature": 1.0, "seed": 0,
                                                     "logprobs": 0, "ignore_eos": True}}
    request = urllib.request.Request(
        url + "/inference/v1/generate",
        data=json.dumps(body).encode(),
        method="POST",
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=120) as response:
        choice = json.loads(response.read())["choices"][0]
    return choice["token_ids"], [e["logprob"] for e in choice["logprobs"]["content"]]


@pytest.mark.slow
def test_a_hybrid_vision_language_checkpoint_trains_against_the_embedded_server(tmp_path):
    path = save_hybrid_vision_language(tmp_path / "qwen3_5", media=False)
    rows = [{"prompt": [{"role": "user", "content": f"say {i}"}]} for i in range(16)]
    with EmbeddedServer(path, log_path=tmp_path / "server.log", extra_args=["--dtype", "float32"]) as server:
        args = AsyncGRPOConfig(
            output_dir=str(tmp_path / "out"),
            vllm_server_base_url=server.url,
            num_generations=4,
            max_completion_length=24,
            learning_rate=1e-3,
            bf16=False,
            use_cpu=True,
            gradient_checkpointing=False,
            save_strategy="no",
            report_to="none",
            disable_tqdm=True,
            logging_steps=1,
            max_steps=3,
            seed=0,
            token_budget=512,
        )
        trainer = AsyncGRPOTrainer(model=path, reward_funcs=text_length_reward, train_dataset=rows, args=args)
        deltanet = trainer.model.model.language_model.layers[0].linear_attn
        before = {"A_log": deltanet.A_log.detach().clone(), "conv": deltanet.conv1d.weight.detach().clone()}
        trainer.train()

        # the server holds the trained text model (DeltaNet parameters included) ...
        sent = weights_checksum(weights_for_server(trainer.model, torch.float32))
        assert checksum_mismatches(sent, asyncio.run(served_checksum(server.url))) == []
        assert not torch.equal(before["A_log"], deltanet.A_log.detach())
        assert not torch.equal(before["conv"], deltanet.conv1d.weight.detach())
        # ... and its log-probs are the trained model's
        prompt = list(range(20, 45))
        output, logprobs = served_logprobs(server.url, prompt, max_tokens=30)
    trained = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    trained.load_state_dict(trainer.model.state_dict())
    with torch.no_grad():
        logits = trained(input_ids=torch.tensor([prompt + output]), use_cache=False).logits[
            0, len(prompt) - 1 : -1
        ]
    expected = torch.log_softmax(logits, -1).gather(1, torch.tensor(output)[:, None])[:, 0]
    torch.testing.assert_close(torch.tensor(logprobs), expected, atol=1e-4, rtol=0)

    logs = [e for e in trainer.state.log_history if "loss" in e]
    assert len(logs) == 3 and all(math.isfinite(e["loss"]) for e in logs)
    # step 0 trains on samples of the checkpoint's own weights: sampler and trainer log-probs agree
    assert logs[0]["sampling/sampling_logp_difference/mean"] <= 1e-4
