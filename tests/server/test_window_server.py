"""`asyncgrpo serve` on a tiny random Mistral with a sliding window of 8 tokens (float32, CPU): with a
KV cache of 128 tokens (8 blocks), four requests of 20 + 100 tokens (each nearly the whole cache)
run together in one forward pass per step without a preemption, because blocks behind the window
are freed (each holds at most 2 blocks), and their log-probs equal the model's own forward."""

from __future__ import annotations

import json
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from transformers import MistralConfig, MistralForCausalLM

from asyncgrpo.launch import EmbeddedServer

pytestmark = pytest.mark.process

VOCAB, WINDOW = 97, 8


@pytest.fixture(scope="module")
def mistral(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_mistral_sw8")
    torch.manual_seed(0)
    config = MistralConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                           max_position_embeddings=256, sliding_window=WINDOW, bos_token_id=1, eos_token_id=2)
    model = MistralForCausalLM(config).eval()
    model.save_pretrained(path)
    model.set_attn_implementation("eager")
    return path, model


def _post(url: str, path: str, body: dict) -> dict:
    req = urllib.request.Request(url + path, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        return json.loads(resp.read())


def _metric(url: str, name: str) -> float:
    with urllib.request.urlopen(url + "/metrics", timeout=30) as resp:
        for line in resp.read().decode().splitlines():
            if line.startswith(name + "{"):
                return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)


@pytest.mark.slow
def test_requests_as_long_as_the_whole_cache_decode_together_past_the_window(mistral, tmp_path):
    path, reference = mistral
    args = ["--dtype", "float32", "--max-model-len", "128", "--kv-cache-tokens", "128", "--max-num-seqs", "8"]
    log = tmp_path / "server.log"
    prompts = [torch.randint(3, VOCAB, (20,), generator=torch.Generator().manual_seed(i)).tolist()
               for i in range(4)]
    with EmbeddedServer(str(path), extra_args=args, log_path=log) as server:
        def generate(i: int) -> dict:
            sp = {"max_tokens": 100, "temperature": 1.0, "seed": i, "ignore_eos": True, "logprobs": 1}
            return _post(server.url, "/inference/v1/generate",
                         {"token_ids": prompts[i], "sampling_params": sp})

        with ThreadPoolExecutor(4) as pool:
            bodies = list(pool.map(generate, range(4)))
        assert _metric(server.url, "vllm:num_preemptions_total") == 0
        assert _metric(server.url, "asyncgrpo:max_num_seqs_per_step") == 4
    assert "KV blocks behind it are freed" in log.read_text()
    for prompt, body in zip(prompts, bodies):
        choice = body["choices"][0]
        tokens = choice["token_ids"]
        assert len(tokens) == 100
        with torch.no_grad():
            logits = reference(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1]
        expected = torch.log_softmax(logits.float(), -1).gather(1, torch.tensor(tokens)[:, None])[:, 0]
        got = torch.tensor([entry["logprob"] for entry in choice["logprobs"]["content"]])
        torch.testing.assert_close(got, expected, atol=2e-4, rtol=0)
