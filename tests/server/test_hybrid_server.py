"""`asyncgrpo serve` on a tiny random Qwen3.5 vision-language checkpoint saved to disk (its text model
a Gated DeltaNet hybrid): it serves the text model, with log-probs equal to the checkpoint's own
forward over concurrent requests, and refuses image content with a 400."""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
import urllib.error
import urllib.request

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from transformers import AutoModelForImageTextToText
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

from asyncgrpo.launch import EmbeddedServer
from asyncgrpo.modeling.deltanet.layer import deltanet_layers
from asyncgrpo.modeling.load import BUNDLED_MODELS

pytestmark = pytest.mark.process

TINY_CHAT = BUNDLED_MODELS["asyncgrpo/tiny-chat"]
MEDIA = {"image_token_id": 491, "video_token_id": 492, "vision_start_token_id": 493,
         "vision_end_token_id": 494}
_TEXT = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 3,
         "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "max_position_embeddings": 512,
         "eos_token_id": 484, "pad_token_id": 482, "tie_word_embeddings": False, "linear_num_key_heads": 2,
         "linear_num_value_heads": 4, "linear_key_head_dim": 8, "linear_value_head_dim": 8,
         "layer_types": ["linear_attention", "full_attention", "linear_attention"]}
_VISION = {"depth": 1, "hidden_size": 16, "intermediate_size": 32, "num_heads": 2, "out_hidden_size": 32,
           "patch_size": 4, "spatial_merge_size": 2, "temporal_patch_size": 2, "num_position_embeddings": 16}


def save_hybrid_vision_language(folder, media: bool = True) -> str:
    """A tiny random Qwen3.5 checkpoint with the bundled tokenizer; `media`: image/video placeholder
    ids inside its vocabulary (`MEDIA`, past the tokenizer's 491 tokens), else the family's defaults
    (outside it, so a sampled token is always text). Its DeltaNet layers decay slowly and weigh on
    the output (a random model's decay forgets the state within a few tokens), so a recurrent state
    not carried between steps shows far beyond the tolerances."""
    text = dict(_TEXT, vocab_size=495 if media else 491)
    config = CONFIG_MAPPING["qwen3_5"](text_config=text, vision_config=_VISION, tie_word_embeddings=False,
                                       **(MEDIA if media else {}))
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_config(config)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for layer in deltanet_layers(model):
            layer.A_log.copy_(torch.empty_like(layer.A_log).uniform_(-4.0, -1.0, generator=gen))
            layer.out_proj.weight.mul_(4.0)
    model.save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(os.path.join(TINY_CHAT, name), folder)
    return str(folder)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    return save_hybrid_vision_language(tmp_path_factory.mktemp("qwen3_5"))


@pytest.fixture(scope="module")
def server(checkpoint, tmp_path_factory):
    log = tmp_path_factory.mktemp("logs") / "server.log"
    # asynchronous steps, as on CUDA: each sequence's DeltaNet state advances once per recorded token
    with EmbeddedServer(checkpoint, log_path=log, extra_args=["--dtype", "float32", "--max-model-len", "256",
                                                              "--max-num-seqs", "8",
                                                              "--async-scheduling"]) as running:
        yield running


def post(server, path: str, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(server.url + path, data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


@pytest.mark.slow
def test_served_logprobs_equal_the_checkpoint_forward_across_concurrent_requests(server, checkpoint):
    requests = [(list(range(10, 10 + p)), n) for p, n in ((5, 40), (1, 20), (70, 12), (2, 30), (17, 8))]
    results: dict[int, dict] = {}

    def generate(i: int) -> None:
        time.sleep(0.15 * i)  # later requests join while earlier ones decode
        prompt, max_tokens = requests[i]
        status, body = post(server, "/inference/v1/generate", {"token_ids": prompt, "sampling_params": {
            "max_tokens": max_tokens, "temperature": 1.0, "logprobs": 2, "seed": i, "ignore_eos": True}})
        assert status == 200, body
        results[i] = body["choices"][0]

    threads = [threading.Thread(target=generate, args=(i,)) for i in range(len(requests))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert sorted(results) == list(range(len(requests)))

    model = AutoModelForImageTextToText.from_pretrained(checkpoint, dtype=torch.float32).eval()
    for i, (prompt, max_tokens) in enumerate(requests):
        choice = results[i]
        output = choice["token_ids"]
        assert len(output) == max_tokens
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([prompt + output]),
                           use_cache=False).logits[0, len(prompt) - 1 : -1]
        logprobs = torch.log_softmax(logits.float(), -1)
        served = torch.tensor([e["logprob"] for e in choice["logprobs"]["content"]])
        torch.testing.assert_close(served,
                                   logprobs.gather(1, torch.tensor(output)[:, None])[:, 0], atol=1e-4, rtol=0)
        top = logprobs.topk(2, dim=-1)
        for j, entry in enumerate(choice["logprobs"]["content"]):
            listed = {e["token_id"]: e["logprob"] for e in entry["top_logprobs"]}
            for token, value in zip(top.indices[j].tolist(), top.values[j].tolist()):
                assert listed[token] == pytest.approx(value, abs=1e-4)


def test_image_content_is_refused_with_a_400(server):
    image_prompt = [10, MEDIA["vision_start_token_id"], MEDIA["image_token_id"],
                    MEDIA["vision_end_token_id"], 11]
    status, body = post(server, "/inference/v1/generate", {"token_ids": image_prompt,
                                                          "sampling_params": {"max_tokens": 2}})
    assert status == 400 and "images are not supported yet" in body["error"]["message"]
    assert body["error"]["param"] == "token_ids"
    status, body = post(server, "/v1/completions", {"prompt": [[10, 11], [12, MEDIA["video_token_id"]]],
                                                    "max_tokens": 2})
    assert status == 400 and "images are not supported yet" in body["error"]["message"]
    status, body = post(server, "/inference/v1/generate",
                        {"token_ids": [10, 11], "features": {"mm_hashes": ["x"]},
                         "sampling_params": {"max_tokens": 2}})
    assert status == 400 and "images are not supported yet" in body["error"]["message"]
    status, body = post(server, "/inference/v1/generate",
                        {"token_ids": [10, 11], "sampling_params": {"max_tokens": 2}})
    assert status == 200 and len(body["choices"][0]["token_ids"]) >= 1
