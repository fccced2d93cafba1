"""LoRA adapters in the embedded server (`--enable-lora`), against PEFT on CPU.

One real server (the bundled tiny model, float32, --max-lora-rank 8, --max-loras 2; on a GPU machine
`ASYNCGRPO_TEST_SERVER_DEVICE=cuda` serves it on CUDA). Adapters are
made with peft on the same model (random lora_B, so they change the output) and saved with
save_pretrained, as the trainer does. The reference of an adapter is the merged PEFT model's forward
(`merge_and_unload`) on prompt + generated tokens: a server that loads an adapter but does not apply
it (or applies another one, or reuses the base model's cached KV) fails these tests.
"""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch

from asyncgrpo.launch import EmbeddedServer
from asyncgrpo.modeling.load import resolve_model_path

pytestmark = pytest.mark.process

os.environ.setdefault("HF_HUB_OFFLINE", "1")
peft = pytest.importorskip("peft")

TINY = "asyncgrpo/tiny-chat"
DEVICE = os.environ.get("ASYNCGRPO_TEST_SERVER_DEVICE", "cpu")  # cuda: the fused Triton path, eager decode
TOL = 2e-4 if DEVICE == "cpu" else 2e-3  # float32 on both sides; the reference runs on the CPU
# > one 16-token block
PROMPT = [5, 17, 42, 99, 7, 250, 31, 8, 64, 12, 300, 2, 77, 140, 9, 33, 21, 180, 6, 55]


def call(url: str, path: str, body: Any = None, method: str = "POST") -> tuple[int, Any]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url + path, data=data, method=method,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            status, text, ctype = resp.status, resp.read().decode(), resp.headers.get("Content-Type", "")
    except urllib.error.HTTPError as err:
        status, text, ctype = err.code, err.read().decode(), err.headers.get("Content-Type", "")
    return status, (json.loads(text) if "json" in ctype else text)


def _base_model():
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(resolve_model_path(TINY), dtype=torch.float32).eval()


def make_adapter(path: Path, seed: int, **lora_kwargs) -> torch.nn.Module:
    """Save a PEFT adapter with random A and B at `path`; return the merged model (the reference)."""
    torch.manual_seed(seed)
    config = peft.LoraConfig(init_lora_weights=False, **lora_kwargs)
    model = peft.get_peft_model(_base_model(), config)
    with torch.no_grad():  # large enough to move log-probs well beyond the tolerance
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.mul_(4.0)
    model.save_pretrained(path)
    return model.merge_and_unload().eval()


@torch.no_grad()
def reference_logprobs(model: torch.nn.Module, prompt: list[int], output: list[int]) -> torch.Tensor:
    ids = torch.tensor([prompt + output])
    logp = torch.log_softmax(model(ids).logits[0].float(), dim=-1)
    return logp[len(prompt) - 1 : -1].gather(1, torch.tensor(output)[:, None])[:, 0]


def generate(url: str, model: str | None, prompt: list[int] = PROMPT, seed: int = 0,
             max_tokens: int = 8) -> dict:
    body = {"token_ids": prompt,
            "sampling_params": {"max_tokens": max_tokens, "temperature": 1.0, "seed": seed, "logprobs": 0,
                                "ignore_eos": True}}
    if model is not None:
        body["model"] = model
    status, out = call(url, "/inference/v1/generate", body)
    assert status == 200, out
    return out


def served(out: dict) -> tuple[list[int], torch.Tensor]:
    choice = out["choices"][0]
    return choice["token_ids"], torch.tensor([t["logprob"] for t in choice["logprobs"]["content"]])


def gap(out: dict, reference: torch.nn.Module, prompt: list[int] = PROMPT) -> float:
    tokens, logprobs = served(out)
    return float((logprobs - reference_logprobs(reference, prompt, tokens)).abs().max())


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    refs = {
        "a1": make_adapter(root / "a1", 1, r=4, lora_alpha=8, target_modules="all-linear"),
        # another rank, scaling rule and subset of modules (the others keep zeros in its slot)
        "a2": make_adapter(root / "a2", 2, r=8, lora_alpha=4, use_rslora=True,
                           target_modules=["q_proj", "v_proj", "o_proj", "down_proj"]),
        "big": make_adapter(root / "big", 3, r=16, lora_alpha=16, target_modules=["q_proj"]),
        "a3": make_adapter(root / "a3", 4, r=4, lora_alpha=32, target_modules=["gate_proj", "up_proj"]),
    }
    return root, refs


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log = tmp_path_factory.mktemp("server") / "server.log"
    # asynchronous steps, as on CUDA: adapter loads and unloads wait for the step in flight
    args = ["--enable-lora", "--max-lora-rank", "8", "--max-loras", "2", "--dtype", "float32",
            "--max-model-len", "256", "--async-scheduling"]
    with EmbeddedServer(TINY, log_path=log, device=DEVICE, extra_args=args) as s:
        yield s


def load(url: str, name: str, path: Path | str, **extra) -> tuple[int, Any]:
    return call(url, "/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(path), **extra})


def unload(url: str, name: str) -> tuple[int, Any]:
    return call(url, "/v1/unload_lora_adapter", {"lora_name": name})


def test_served_adapter_equals_merged_peft_model_and_differs_from_base(server, adapters):
    root, refs = adapters
    base = _base_model()
    assert load(server.url, "a1", root / "a1") == (200, "Success: LoRA adapter 'a1' added successfully.")
    try:
        out = generate(server.url, "a1")
        assert out["model"] == "a1"
        assert gap(out, refs["a1"]) < TOL
        assert gap(out, base) > 0.05  # the adapter is applied, not silently dropped
        base_out = generate(server.url, None)
        assert gap(base_out, base) < TOL
        # the same prompt under the adapter again: its KV blocks are cached apart from the base model's
        assert gap(generate(server.url, "a1", seed=1), refs["a1"]) < TOL
        status, body = call(server.url, "/v1/completions", {"model": "a1", "prompt": PROMPT, "max_tokens": 4,
                                                             "logprobs": 0, "seed": 3,
                                                             "return_token_ids": True})
        assert status == 200 and body["model"] == "a1"
        choice = body["choices"][0]
        logprobs = torch.tensor(choice["logprobs"]["token_logprobs"])
        expected = reference_logprobs(refs["a1"], PROMPT, choice["token_ids"])
        assert float((logprobs - expected).abs().max()) < TOL
    finally:
        assert unload(server.url, "a1") == (200, "Success: LoRA adapter 'a1' removed successfully.")


def test_two_adapters_and_the_base_model_in_one_batch_each_match_their_reference(server, adapters):
    root, refs = adapters
    refs = {**refs, None: _base_model()}
    assert load(server.url, "a1", root / "a1")[0] == 200
    assert load(server.url, "a2", root / "a2")[0] == 200
    try:
        jobs = [(name, seed) for seed in range(4) for name in ("a1", "a2", None)]
        prompts = {(name, seed): PROMPT[seed:] + PROMPT[:seed] for name, seed in jobs}
        with ThreadPoolExecutor(len(jobs)) as pool:
            outs = list(pool.map(lambda job: generate(server.url, job[0], prompts[job], job[1], 16), jobs))
        for job, out in zip(jobs, outs):
            assert gap(out, refs[job[0]], prompts[job]) < TOL, job
        _, info = call(server.url, "/server_info?config_format=json", method="GET")
        assert info["embedded"]["max_num_seqs_per_step"] >= 3
        assert info["vllm_config"]["lora_config"]["max_loras"] == 2
        status, models = call(server.url, "/v1/models", method="GET")
        assert status == 200
        cards = {c["id"]: c for c in models["data"]}
        assert [c["id"] for c in models["data"]][1:] == ["a1", "a2"]
        assert cards["a2"]["root"] == str(root / "a2") and cards["a2"]["parent"] == models["data"][0]["id"]
        assert cards["a2"]["max_model_len"] is None and cards["a2"]["object"] == "model"
    finally:
        unload(server.url, "a1")
        unload(server.url, "a2")


def test_unloading_returns_requests_to_404_and_the_slot_to_new_adapters(server, adapters):
    root, refs = adapters
    assert load(server.url, "a1", root / "a1")[0] == 200
    assert unload(server.url, "a1")[0] == 200
    status, body = call(server.url, "/inference/v1/generate", {"model": "a1", "token_ids": PROMPT})
    base = call(server.url, "/v1/models", method="GET")[1]["data"][0]["id"]
    assert status == 404 and body["error"] == {  # vLLM 0.33's answer, word for word
        "message": f"The model `a1` does not exist. Valid aliases: {base}.", "type": "NotFoundError",
        "param": "model", "code": 404}
    status, body = unload(server.url, "a1")
    assert status == 404 and body["error"] == {
        "message": "The lora adapter 'a1' cannot be found.", "type": "NotFoundError",
        "param": None, "code": 404}
    assert gap(generate(server.url, None), _base_model()) < TOL
    # both slots free again: another adapter takes one, and serves its own weights (not a1's leftovers)
    assert load(server.url, "a3", root / "a3")[0] == 200
    try:
        out = generate(server.url, "a3")
        assert gap(out, refs["a3"]) < TOL and gap(out, _base_model()) > 0.05
    finally:
        unload(server.url, "a3")


def test_failed_loads_answer_vllm_errors_and_leave_the_loaded_adapters_serving(server, adapters, tmp_path):
    root, refs = adapters
    assert load(server.url, "a1", root / "a1")[0] == 200
    try:
        status, body = load(server.url, "big", root / "big")
        assert status == 500 and body["error"]["type"] == "InternalServerError"
        assert "LoRA rank 16 is greater than max_lora_rank 8" in body["error"]["message"]
        assert "--max-lora-rank 16" in body["error"]["message"]

        status, body = load(server.url, "gone", tmp_path / "nowhere")
        assert status == 404 and body["error"]["message"] == (
            f"Loading lora gone failed: No adapter found for {tmp_path / 'nowhere'}")

        bad = tmp_path / "bad"  # an adapter of modules this model does not have
        bad.mkdir()
        (bad / "adapter_config.json").write_text((root / "a3" / "adapter_config.json").read_text())
        from safetensors.torch import save_file

        save_file({"base_model.model.model.layers.0.mlp.bogus_proj.lora_A.weight": torch.zeros(4, 128),
                   "base_model.model.model.layers.0.mlp.bogus_proj.lora_B.weight": torch.zeros(128, 4)},
                  str(bad / "adapter_model.safetensors"))
        status, body = load(server.url, "bad", bad)
        assert status == 500 and "expected target modules in" in body["error"]["message"]
        assert "model.layers.0.mlp.bogus_proj" in body["error"]["message"]

        status, body = load(server.url, "a1", root / "a2")
        assert status == 400 and body["error"]["type"] == "InvalidUserInput"
        assert "has already been loaded" in body["error"]["message"]
        status, body = load(server.url, TINY, root / "a2")
        assert status == 400 and "conflicts with a served base model" in body["error"]["message"]
        status, body = call(server.url, "/v1/load_lora_adapter", {"lora_name": "x"})
        assert status == 400

        assert load(server.url, "a2", root / "a2")[0] == 200
        status, body = load(server.url, "a3", root / "a3")  # both slots taken
        assert status == 500 and "No free lora slots" in body["error"]["message"]
        assert "--max-loras" in body["error"]["message"]

        _, models = call(server.url, "/v1/models", method="GET")
        assert [c["id"] for c in models["data"]][1:] == ["a1", "a2"]
        assert gap(generate(server.url, "a1"), refs["a1"]) < TOL
        assert gap(generate(server.url, "a2"), refs["a2"]) < TOL
    finally:
        unload(server.url, "a1")
        unload(server.url, "a2")


def test_reload_in_place_serves_the_new_weights(server, adapters):
    root, refs = adapters
    assert load(server.url, "v", root / "a1")[0] == 200
    try:
        assert gap(generate(server.url, "v"), refs["a1"]) < TOL
        assert load(server.url, "v", root / "a3", load_inplace=True)[0] == 200
        # same prompt, same name: the blocks cached under the first weights must not be reused
        assert gap(generate(server.url, "v"), refs["a3"]) < TOL
        _, models = call(server.url, "/v1/models", method="GET")
        assert [(c["id"], c["root"]) for c in models["data"]][1:] == [("v", str(root / "a3"))]
    finally:
        unload(server.url, "v")


def test_adapters_load_and_unload_while_generation_is_paused(server, adapters):
    """The trainer pauses the server (mode=keep) around a sync: the load must not wait for a resume."""
    root, refs = adapters
    assert call(server.url, "/pause?mode=keep")[0] == 200
    try:
        assert load(server.url, "p", root / "a1")[0] == 200
    finally:
        assert call(server.url, "/resume")[0] == 200
    assert gap(generate(server.url, "p"), refs["a1"]) < TOL
    assert call(server.url, "/pause?mode=keep")[0] == 200
    try:
        assert unload(server.url, "p")[0] == 200
    finally:
        assert call(server.url, "/resume")[0] == 200
