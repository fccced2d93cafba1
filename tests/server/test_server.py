"""Conformance of the embedded server (`asyncgrpo serve`) with vLLM 0.33's protocol, on CPU.

Two real server subprocesses share a random tiny Qwen3 (built here, no hub):
- `main`: sampling masks on, room for 64 concurrent sequences;
- `small`: max_model_len 64, a KV cache of 128 tokens (forces preemption), 16 tokens per step (prompts
  are prefilled in chunks), an API key, masks off.
Log-probs, top-K lists and candidate sets are checked against the Hugging Face model run directly
on prompt + generated tokens with a plain per-position loop.

On a GPU machine the same suite checks the CUDA engine (paged attention, decode CUDA graphs) against
the CPU reference: `ASYNCGRPO_TEST_SERVER_DEVICE=cuda pytest tests/server/test_server.py`
(fp32 on both sides; `ASYNCGRPO_TEST_SERVER_EAGER=1` adds `--enforce-eager`).
"""

from __future__ import annotations

import json
import math
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from itertools import chain
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.process

os.environ.setdefault("HF_HUB_OFFLINE", "1")

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "vllm" / "protocol-0.33.0.json"
EOS, EXTRA_EOS = 0, 1  # "<|endoftext|>" (tokenizer + generation config) and a second config EOS


def _build_model(path: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import GenerationConfig, PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = ["def foo(x): return x + 1", "hello world, this is a test", "the quick brown fox jumps"] * 20
    trainer = trainers.BpeTrainer(
        vocab_size=320, special_tokens=["<|endoftext|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")
    assert fast.eos_token_id == EOS
    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=len(fast), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
        tie_word_embeddings=False, eos_token_id=EOS,
    )
    model = Qwen3ForCausalLM(config)
    with torch.no_grad():  # make both EOS ids likely, so that requests without ignore_eos stop early
        model.lm_head.weight[[EOS, EXTRA_EOS]] *= 6.0
    model.save_pretrained(path)
    fast.save_pretrained(path)
    GenerationConfig(eos_token_id=[EOS, EXTRA_EOS]).save_pretrained(path)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


SERVER_DEVICE = os.environ.get("ASYNCGRPO_TEST_SERVER_DEVICE", "cpu")
DEVICE_ARGS = ("--device", SERVER_DEVICE, "--dtype", "float32") + (
    ("--enforce-eager",) if os.environ.get("ASYNCGRPO_TEST_SERVER_EAGER") == "1" else ()
)


class Server:
    def __init__(self, model: Path, log: Path, *args: str) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        cmd = [sys.executable, "-m", "asyncgrpo.cli", "serve", str(model), "--port", str(self.port),
               *DEVICE_ARGS, *args]
        self._log = open(log, "w")  # noqa: SIM115 -- closed in stop()
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=dict(os.environ))
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, log.read_text()
            try:
                if self.call("GET", "/health")[0] == 200:
                    return
            except OSError:
                time.sleep(0.2)
        raise TimeoutError(log.read_text())

    def call(self, method: str, path: str, body=None, headers=None, raw: bool = False, timeout: float = 60):
        data = body if isinstance(body, bytes) else (json.dumps(body).encode() if body is not None else None)
        req = urllib.request.Request(self.url + path, data=data, method=method, headers=headers or {})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                status, text, ctype = resp.status, resp.read().decode(), resp.headers.get("Content-Type", "")
        except urllib.error.HTTPError as err:
            status, text, ctype = err.code, err.read().decode(), err.headers.get("Content-Type", "")
        if raw or not text or "json" not in ctype:
            return status, text
        return status, json.loads(text)

    def gen(self, token_ids, headers=None, **sampling):
        body = {"token_ids": token_ids, "sampling_params": sampling}
        return self.call("POST", "/inference/v1/generate", body, headers)

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._log.close()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tiny_qwen3")
    _build_model(path)
    return path


@pytest.fixture(scope="module")
def main(model_dir, tmp_path_factory):
    # asynchronous steps, the default on CUDA (`small` steps synchronously, the default on CPU)
    server = Server(model_dir, tmp_path_factory.mktemp("logs") / "main.log", "--async-scheduling",
                    "--return-sampling-mask", "--max-model-len", "256", "--max-num-seqs", "64")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def small(model_dir, tmp_path_factory):
    server = Server(model_dir, tmp_path_factory.mktemp("logs") / "small.log", "--max-model-len", "64",
                    "--kv-cache-tokens", "128", "--max-num-seqs", "8", "--api-key", "sekrit",
                    "--max-num-batched-tokens", "16")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def hf_model(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def fixtures() -> dict:
    return json.loads(FIXTURES.read_text())


AUTH = {"Authorization": "Bearer sekrit"}
PROMPT = [5, 6, 7, 8, 9, 10, 11]


def _same_shape(ours, ref, where="$"):
    """Same keys at every level; null exactly where the reference is null or ours is null by design."""
    if isinstance(ref, dict) and ref and all(isinstance(v, float) for v in ref.values()):
        # token -> lp
        assert isinstance(ours, dict) and all(isinstance(v, float) for v in ours.values()), where
    elif isinstance(ref, dict):
        assert isinstance(ours, dict), where
        assert set(ours) == set(ref), (where, set(ours) ^ set(ref))
        for k in ref:
            if ref[k] is not None and ours[k] is not None:
                _same_shape(ours[k], ref[k], f"{where}.{k}")
    elif isinstance(ref, list) and ref and isinstance(ours, list) and ours:
        _same_shape(ours[0], ref[0], f"{where}[0]")
    elif ref is not None:
        assert type(ours) is type(ref) or {type(ours), type(ref)} <= {int, float}, (where, ours, ref)


# --- reference computation ---------------------------------------------------------------------


def _reference_steps(hf_model, prompt, output, sp):
    """Per output position: (candidate ids, processed log-probs) from a plain loop over the vocab."""
    with torch.no_grad():
        logits = hf_model(torch.tensor([prompt + output])).logits[0, len(prompt) - 1 : -1].float()
    t = sp.get("temperature", 1.0) or 1.0
    steps = []
    for row in logits:
        scaled = (row / torch.tensor(t, dtype=torch.float32)).tolist()
        order = sorted(range(len(scaled)), key=lambda j: (-scaled[j], j))
        top = scaled[order[0]]
        kept = [j for j in order if sp.get("min_p", 0.0) == 0 or scaled[j] >= top + math.log(sp["min_p"])]
        if sp.get("top_k", 0) > 0:
            kept = kept[: sp["top_k"]]
        if sp.get("top_p", 1.0) < 1.0:
            z = sum(math.exp(scaled[j] - top) for j in kept)
            mass, out = 0.0, []
            for j in kept:
                if mass < sp["top_p"]:
                    out.append(j)
                mass += math.exp(scaled[j] - top) / z
            kept = out
        lse = top + math.log(sum(math.exp(scaled[j] - top) for j in kept))
        kept_set = set(kept)
        lps = [scaled[j] - lse if j in kept_set else -math.inf for j in range(len(scaled))]
        steps.append((kept, lps, order))
    return steps


def _check_against_reference(hf_model, prompt, choice, sp):
    tokens = choice["token_ids"]
    k = sp.get("logprobs")
    for i, (kept, lps, order) in enumerate(_reference_steps(hf_model, prompt, tokens, sp)):
        tok = tokens[i]
        entry = choice["logprobs"]["content"][i]
        assert entry["token_id"] == tok and tok in kept
        assert entry["logprob"] == pytest.approx(lps[tok], abs=1e-4)
        assert entry["rank"] == sum(1 for x in lps if x >= lps[tok] - 1e-6)
        top = entry["top_logprobs"]
        assert top[0] == {"token_id": tok, "logprob": entry["logprob"], "rank": entry["rank"]}
        expected = [(j, r) for r, j in enumerate(order[:k], start=1) if j != tok]
        assert [(e["token_id"], e["rank"]) for e in top[1:]] == expected
        for e in top[1:]:
            ref = lps[e["token_id"]]
            assert e["logprob"] == (-9999.0 if ref == -math.inf else pytest.approx(ref, abs=1e-4))
        if choice["sampling_mask"] is not None:
            assert choice["sampling_mask"][i] == sorted(kept)


# --- description routes -----------------------------------------------------------------------


def test_description_routes(main, fixtures):
    assert main.call("GET", "/health") == (200, "")
    assert main.call("GET", "/version") == (200, {"version": "0.33.0+embedded"})
    status, models = main.call("GET", "/v1/models")
    assert status == 200
    _same_shape(models, fixtures["models"]["response"])
    assert models["data"][0]["max_model_len"] == 256
    assert main.call("GET", "/get_world_size?include_dp=true") == (200, {"world_size": 1})
    status, info = main.call("GET", "/server_info?config_format=json")
    mc, cc = info["vllm_config"]["model_config"], info["vllm_config"]["cache_config"]
    assert ((mc["max_model_len"], mc["dtype"], mc["logprobs_mode"])
            == (256, "torch.float32", "processed_logprobs"))
    assert mc["return_sampling_mask"] is True and mc["max_logprobs"] == 20
    assert cc["block_size"] == 16 and cc["kv_cache_size_tokens"] == 64 * 256
    assert cc["num_gpu_blocks"] * 16 == cc["kv_cache_size_tokens"]
    assert info["vllm_config"]["parallel_config"]["tensor_parallel_size"] == 1
    assert info["vllm_config"]["scheduler_config"]["async_scheduling"] is True
    assert info["embedded"]["prompt_attention"] == "padded"  # FlashAttention's kernel is CUDA-only
    assert main.call("GET", "/weight_info") == (200, {"weight_version": "default"})
    assert main.call("GET", "/is_paused") == (200, {"is_paused": False})
    assert main.call("POST", "/v1/load_lora_adapter", {"lora_name": "a", "lora_path": "/x"})[0] == 404
    assert main.call("POST", "/v1/unload_lora_adapter", {"lora_name": "a"})[0] == 404


def test_metrics_series_and_labels(main):
    status, text = main.call("GET", "/metrics")
    assert status == 200
    labels = f'engine="0",model_name="{main.call("GET", "/v1/models")[1]["data"][0]["id"]}"'
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:num_preemptions_total", "vllm:prefix_cache_queries_total",
                 "vllm:prefix_cache_hits_total"):
        assert f"{name}{{{labels}}} " in text, name
    assert ("# TYPE vllm:num_preemptions_total counter" in text
            or "# TYPE vllm:num_preemptions counter" in text)


# --- generation ---------------------------------------------------------------------------------


def test_generate_matches_fixture_shape_and_request_id(main, fixtures):
    ref = fixtures["generate"]
    status, body = main.gen(PROMPT, headers={"X-Request-Id": "abc"}, **ref["request"]["sampling_params"])
    assert status == 200
    _same_shape(body, ref["response"])
    assert body["request_id"] == "generate-tokens-abc"
    choice = body["choices"][0]
    assert len(choice["token_ids"]) == 8 and choice["finish_reason"] in ("length", "stop")
    assert choice["weight_versions"] == [{"version": "default", "start": 0, "end": len(choice["token_ids"])}]
    assert body["usage"]["completion_tokens"] == len(choice["token_ids"])
    assert body["prompt_token_ids"] is None
    status, body = main.call("POST", "/inference/v1/generate", {
        "token_ids": PROMPT, "request_id": "xyz", "return_token_ids": True,
        "sampling_params": {"top_k": 5, "max_tokens": 2, "n": 2, "ignore_eos": True}})
    assert body["request_id"] == "generate-tokens-xyz" and body["prompt_token_ids"] == PROMPT
    assert [c["index"] for c in body["choices"]] == [0, 1] and body["usage"]["completion_tokens"] == 4
    assert all(c["logprobs"] is None for c in body["choices"])


@pytest.mark.parametrize("sp", [
    {"temperature": 1.0, "top_k": 20, "top_p": 0.9, "logprobs": 5},
    {"temperature": 0.7, "top_k": 50, "min_p": 0.02, "logprobs": 3},
    {"temperature": 1.4, "top_k": 8, "top_p": 0.6, "min_p": 0.01, "logprobs": 20},
    {"temperature": 1.0, "top_k": 3, "logprobs": 0},
])
def test_logprobs_ranks_and_masks_match_direct_model(main, hf_model, sp):
    status, body = main.gen(PROMPT, max_tokens=12, seed=11, ignore_eos=True, n=2, **sp)
    assert status == 200, body
    for choice in body["choices"]:
        assert len(choice["token_ids"]) == 12 and len(choice["sampling_mask"]) == 12
        _check_against_reference(hf_model, PROMPT, choice, sp)


def test_seeds_reproduce_alone_and_inside_a_batch(main):
    sp = {"temperature": 1.0, "top_k": 40, "max_tokens": 16, "ignore_eos": True, "logprobs": 1}
    alone = main.gen(PROMPT, seed=5, **sp)[1]["choices"][0]
    others = [(list(range(3, 3 + n)), 100 + n) for n in range(2, 12)]
    with ThreadPoolExecutor(12) as pool:
        futs = [pool.submit(main.gen, p, seed=s, **sp) for p, s in others]
        mine = pool.submit(main.gen, PROMPT, seed=5, **sp)
        batched = mine.result()[1]["choices"][0]
        assert all(f.result()[0] == 200 for f in futs)
    assert batched["token_ids"] == alone["token_ids"]
    for a, b in zip(alone["logprobs"]["content"], batched["logprobs"]["content"]):
        assert a["logprob"] == pytest.approx(b["logprob"], abs=1e-5)
    other = main.gen(PROMPT, seed=6, **sp)[1]["choices"][0]
    assert other["token_ids"] != alone["token_ids"]
    # n > 1: child i uses seed + i
    children = main.gen(PROMPT, seed=5, n=3, **sp)[1]["choices"]
    assert children[0]["token_ids"] == alone["token_ids"]
    assert children[1]["token_ids"] == other["token_ids"]
    unseeded = {tuple(main.gen(PROMPT, **sp)[1]["choices"][0]["token_ids"]) for _ in range(3)}
    assert len(unseeded) == 3


def test_stream_framing_matches_fixture_and_non_stream_result(main, fixtures):
    sp = {"temperature": 1.0, "top_k": 20, "top_p": 0.9, "logprobs": 5, "seed": 3, "max_tokens": 5,
          "ignore_eos": True}
    full = main.gen(PROMPT, **sp)[1]["choices"][0]
    status, text = main.call("POST", "/inference/v1/generate", {
        "token_ids": PROMPT, "sampling_params": sp, "stream": True,
        "stream_options": {"include_usage": True}})
    assert status == 200
    ref_events = fixtures["generate_stream"]["response"].split("\n\n")
    events = text.split("\n\n")
    assert (events[-1] == "" and events[-2] == "data: [DONE]"
            and all(e.startswith("data: ") for e in events[:-1]))
    chunks = [json.loads(e[6:]) for e in events[:-2]]
    ref_chunks = [json.loads(e[6:]) for e in ref_events[:-3]]
    _same_shape(chunks[0], ref_chunks[0])
    _same_shape(chunks[-2], ref_chunks[-2])
    _same_shape(chunks[-1], ref_chunks[-1])
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 5
    token_chunks = chunks[:-1]
    assert list(chain.from_iterable(c["choices"][0]["token_ids"] for c in token_chunks)) == full["token_ids"]
    assert all(c["choices"][0]["weight_versions"] is None for c in token_chunks[:-1])
    assert token_chunks[-1]["choices"][0]["weight_versions"] == full["weight_versions"]
    assert token_chunks[-1]["choices"][0]["finish_reason"] == "length"
    masks = list(chain.from_iterable(c["choices"][0]["sampling_mask"] for c in token_chunks))
    assert masks == full["sampling_mask"]


def test_eos_and_stop_tokens_are_kept_and_reported(main):
    base = {"temperature": 1.0, "top_k": 50, "max_tokens": 60, "logprobs": 0}
    stops = {}
    for seed in range(30):
        choice = main.gen(PROMPT, seed=seed, **base)[1]["choices"][0]
        last = choice["token_ids"][-1]
        if choice["finish_reason"] == "stop":
            assert last in (EOS, EXTRA_EOS)
            assert choice["stop_reason"] == (None if last == EOS else EXTRA_EOS)
            assert EOS not in choice["token_ids"][:-1] and EXTRA_EOS not in choice["token_ids"][:-1]
            stops[last] = seed
    assert EOS in stops and EXTRA_EOS in stops, stops
    # ignore_eos keeps going; min_tokens bans EOS ids before it is reached
    seed = stops[EOS]
    longer = main.gen(PROMPT, seed=seed, ignore_eos=True, **{**base, "max_tokens": 20})[1]["choices"][0]
    assert len(longer["token_ids"]) == 20 and longer["finish_reason"] == "length"
    held = main.gen(PROMPT, seed=seed, min_tokens=10, **base)[1]["choices"][0]
    assert not {EOS, EXTRA_EOS} & set(held["token_ids"][:9]) and len(held["token_ids"]) >= 10
    # an explicit stop id ends the output (kept) with stop_reason = that id
    target = longer["token_ids"][5]
    first = longer["token_ids"].index(target)
    stopped = main.gen(PROMPT, seed=seed, ignore_eos=True, stop_token_ids=[target], **base)[1]["choices"][0]
    assert stopped["token_ids"] == longer["token_ids"][: first + 1]
    assert (stopped["finish_reason"], stopped["stop_reason"]) == ("stop", target)


def test_sixty_four_requests_share_one_forward_pass(main):
    assert main.call("POST", "/pause?mode=keep&clear_cache=false")[1] == {"status": "paused"}
    sp = {"temperature": 1.0, "top_k": 10, "max_tokens": 6, "ignore_eos": True}
    with ThreadPoolExecutor(64) as pool:
        futs = [pool.submit(main.gen, [5 + i % 50, 6, 7], seed=i, **sp) for i in range(64)]
        deadline = time.monotonic() + 30
        while "vllm:num_requests_waiting" not in main.call("GET", "/metrics")[1] or \
                _metric(main, "vllm:num_requests_waiting") < 64:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert not any(f.done() for f in futs)
        before = main.call("GET", "/server_info?config_format=json")[1]["embedded"]
        main.call("POST", "/resume")
        results = [f.result() for f in futs]
    assert all(s == 200 and len(b["choices"][0]["token_ids"]) == 6 for s, b in results)
    info = main.call("GET", "/server_info?config_format=json")[1]
    assert info["embedded"]["max_num_seqs_per_step"] == 64
    # one step prefills all 64 prompts (and samples their first tokens), five decode the rest
    assert info["embedded"]["num_steps"] - before["num_steps"] == 6
    assert info["embedded"]["num_prefill_steps"] - before["num_prefill_steps"] == 1
    assert info["embedded"]["step_seconds"] > before["step_seconds"]
    phases = {k: v - before["step_phase_seconds"][k]
              for k, v in info["embedded"]["step_phase_seconds"].items()}
    assert set(phases) == {"schedule", "forward", "record", "device_wait"} and min(phases.values()) > 0
    parts = phases["schedule"] + phases["forward"] + phases["record"]
    assert parts <= info["embedded"]["step_seconds"] - before["step_seconds"]
    assert phases["device_wait"] <= phases["forward"]
    assert _metric(main, "asyncgrpo:max_num_seqs_per_step") == 64
    # the same six steps one by one: the prefill of 64 x 3 prompt tokens, then decodes over 4..8 tokens
    steps = main.call("GET", "/server_info?config_format=json&steps=6")[1]["embedded"]["recent_steps"]
    assert [(r["decode"], r["prefill_tokens"], r["kv_tokens"]) for r in steps] == \
        [(0, 192, 0)] + [(64, 0, 64 * n) for n in range(4, 9)]
    assert all(r["forward_ms"] > 0 and 0 <= r["wait_ms"] <= r["record_ms"] for r in steps)
    status, body = main.call("GET", "/server_info?steps=last")
    assert status == 400 and "whole number" in body["error"]["message"]


def _metric(server, name: str) -> float:
    for line in server.call("GET", "/metrics", headers=AUTH)[1].splitlines():
        if line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)


def _start_long_request(server, max_tokens=220, headers=None):
    pool = ThreadPoolExecutor(1)
    fut = pool.submit(server.gen, PROMPT, headers=headers, top_k=20, seed=9, max_tokens=max_tokens,
                      ignore_eos=True, logprobs=0)
    deadline = time.monotonic() + 20
    while _metric(server, "vllm:num_requests_running") < 1:
        assert time.monotonic() < deadline and not fut.done()
        time.sleep(0.01)
    return pool, fut


@pytest.mark.parametrize("clear_cache", ["false", "true"])
def test_pause_keep_freezes_and_resumes_with_identical_output(main, clear_cache):
    reference = main.gen(PROMPT, top_k=20, seed=9, max_tokens=220, ignore_eos=True, logprobs=0)[1]
    preempted = _metric(main, "vllm:num_preemptions_total")
    pool, fut = _start_long_request(main)
    assert main.call("POST", f"/pause?mode=keep&clear_cache={clear_cache}") == (200, {"status": "paused"})
    assert main.call("GET", "/is_paused")[1] == {"is_paused": True}
    queued = pool.submit(main.gen, PROMPT, top_k=5, seed=1, max_tokens=3)  # new requests queue during keep
    time.sleep(0.4)
    assert not fut.done() and not queued.done()
    main.call("POST", "/resume")
    status, body = fut.result(timeout=60)
    assert status == 200 and queued.result(timeout=60)[0] == 200
    choice = body["choices"][0]
    assert choice["finish_reason"] == "length" and choice["token_ids"] == reference["choices"][0]["token_ids"]
    lps = [e["logprob"] for e in choice["logprobs"]["content"]]
    ref_lps = [e["logprob"] for e in reference["choices"][0]["logprobs"]["content"]]
    assert lps == pytest.approx(ref_lps, abs=1e-4)
    if clear_cache == "true":
        assert _metric(main, "vllm:num_preemptions_total") > preempted
    pool.shutdown()


@pytest.mark.parametrize("keep_kv", [False, True])
def test_a_trainers_sync_pause_drops_or_keeps_the_kv_of_requests_in_flight(main, keep_kv):
    """`keep_kv_across_syncs`: the trainer's pause around a push asks for clear_cache=false, and the
    request in flight goes on without being prefilled again; by default it is preempted."""
    from asyncgrpo.train.server_link import ServerLink

    preempted = _metric(main, "vllm:num_preemptions_total")
    pool, fut = _start_long_request(main)
    link = ServerLink(main.url, timeout_s=30, api_key=AUTH["Authorization"].split()[-1], keep_kv=keep_kv)

    async def push():
        assert main.call("GET", "/is_paused")[1] == {"is_paused": True}
        return {"bytes": 0.0, "num_chunks": 0.0}

    try:
        link.while_paused(push)
    finally:
        link.close()
    status, body = fut.result(timeout=60)
    assert status == 200 and len(body["choices"][0]["token_ids"]) == 220
    assert _metric(main, "vllm:num_preemptions_total") - preempted == (0 if keep_kv else 1)
    pool.shutdown()


def test_pause_abort_returns_partial_output_and_refuses_new_requests(main, fixtures):
    pool, fut = _start_long_request(main)
    assert main.call("POST", "/pause")[1] == {"status": "paused"}  # default mode: abort
    status, body = fut.result(timeout=30)
    choice = body["choices"][0]
    assert status == 200 and choice["finish_reason"] == "abort" and len(choice["token_ids"]) < 220
    assert len(choice["logprobs"]["content"]) == len(choice["token_ids"])
    status, body = main.gen(PROMPT, top_k=5, max_tokens=2)
    assert (status, body) == (503, fixtures["completion_while_paused_abort"]["response"])
    assert main.call("POST", "/v1/completions", {"prompt": PROMPT, "top_k": 5})[0] == 503
    assert main.call("POST", "/resume")[1] == {"status": "resumed"}
    assert main.gen(PROMPT, top_k=5, max_tokens=2)[0] == 200
    pool.shutdown()


def test_pause_wait_drains_running_work_first(main):
    pool, fut = _start_long_request(main, max_tokens=120)
    assert main.call("POST", "/pause?mode=wait")[1] == {"status": "paused"}
    # the drained request ran to its end (an abort would say "abort"); its response may reach the
    # client thread a moment after the pause response
    choice = fut.result(timeout=30)[1]["choices"][0]
    assert choice["finish_reason"] == "length" and len(choice["token_ids"]) == 120
    assert main.gen(PROMPT, top_k=5, max_tokens=2)[0] == 503
    main.call("POST", "/resume")
    pool.shutdown()


def test_abort_requests_route(main):
    pool, fut = _start_long_request(main, headers={"X-Request-Id": "victim"})
    status, body = main.call("POST", "/abort_requests", {"request_ids": ["generate-tokens-victim"]})
    assert (status, body) == (200, {"status": "aborted", "aborted": 1})
    assert fut.result(timeout=30)[1]["choices"][0]["finish_reason"] == "abort"
    assert main.call("POST", "/abort_requests", {"request_ids": ["nope"]})[1]["aborted"] == 0
    pool.shutdown()


def test_pause_route_errors(main):
    status, body = main.call("POST", "/pause?mode=bogus")
    assert status == 400 and set(body) == {"error"}
    assert main.call("GET", "/is_paused")[1] == {"is_paused": False}


# --- validation ---------------------------------------------------------------------------------


@pytest.mark.parametrize("sp,param", [
    ({"temperature": 2.5, "top_k": 5}, "temperature"),
    ({"top_p": 0.0, "top_k": 5}, "top_p"),
    ({"top_p": 1.5, "top_k": 5}, "top_p"),
    ({"max_tokens": 0, "top_k": 5}, "max_tokens"),
    ({"logprobs": 21, "top_k": 5}, "logprobs"),
    ({"n": 65, "top_k": 5}, "n"),
    ({"temperature": 0.0, "top_k": 5}, "top_k"),  # sampling masks need temperature > 0 ...
    ({"temperature": 1.0}, "top_k"),  # ... and top_k > 0
])
def test_invalid_sampling_params_are_400(main, sp, param):
    status, body = main.gen(PROMPT, **sp)
    assert status == 400
    assert body["error"]["type"] == "BadRequestError" and body["error"]["code"] == 400
    assert body["error"]["param"] == param and body["error"]["message"]


def test_bad_ids_model_and_json(main, fixtures):
    for ids in ([], [-1], [10**6], ["a"]):
        assert main.call("POST", "/inference/v1/generate",
                         {"token_ids": ids, "sampling_params": {"top_k": 5}})[0] == 400
    status, body = main.call("POST", "/inference/v1/generate", {"token_ids": PROMPT, "model": "other",
                                                                "sampling_params": {"top_k": 5}})
    assert status == 404 and body["error"]["type"] == "NotFoundError" and body["error"]["code"] == 404
    assert main.call("POST", "/inference/v1/generate", b"{not json")[0] == 400
    # completions answers the mask-incompatible request like vLLM 0.33 (500 InternalServerError)
    ref = fixtures["completions_greedy_INVALID_with_sampling_mask"]
    status, body = main.call("POST", "/v1/completions", ref["request"] | {"model": None})
    assert status == 500 and set(body["error"]) == set(ref["response"]["error"])
    assert body["error"]["type"] == "InternalServerError"


def test_completions_shapes_text_and_token_prompts(main, fixtures):
    ref = fixtures["completions_tokens"]
    req = {**ref["request"], "model": None, "prompt": PROMPT}
    status, body = main.call("POST", "/v1/completions", req)
    assert status == 200
    _same_shape(body, ref["response"])
    choice = body["choices"][0]
    lp = choice["logprobs"]
    assert (len(lp["tokens"]) == len(choice["token_ids"]) == len(lp["token_logprobs"])
            == len(lp["top_logprobs"]))
    assert all(1 <= len(t) <= 6 for t in lp["top_logprobs"])  # texts of byte tokens may collide
    assert body["usage"]["prompt_tokens"] == len(PROMPT)
    status, body = main.call("POST", "/v1/completions", {"prompt": "hello world", "top_k": 5, "max_tokens": 3,
                                                         "return_tokens_as_token_ids": True, "logprobs": 1,
                                                         "return_weight_versions": True})
    choice = body["choices"][0]
    assert status == 200 and isinstance(choice["text"], str) and choice["token_ids"] is None
    assert all(t.startswith("token_id:") for t in choice["logprobs"]["tokens"])
    assert all(len(t) in (1, 2) for t in choice["logprobs"]["top_logprobs"])
    assert choice["weight_versions"][0]["version"] == "default"
    status, body = main.call("POST", "/v1/completions", {"prompt": [PROMPT, PROMPT[:3]], "top_k": 5, "n": 2,
                                                         "max_tokens": 2})
    assert status == 200 and [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    status, tok = main.call("POST", "/tokenize", {"prompt": "hello world"})
    assert status == 200 and tok["count"] == len(tok["tokens"]) and tok["max_model_len"] == 256
    assert main.call("POST", "/detokenize", {"tokens": tok["tokens"]})[1] == {"prompt": "hello world"}


def test_context_length_rules(small):
    sp = {"temperature": 1.0, "top_k": 5, "ignore_eos": True}
    assert small.gen(list(range(2, 66)), headers=AUTH, **sp)[0] == 400  # prompt == max_model_len
    status, body = small.gen(list(range(2, 65)), headers=AUTH, **sp)  # 63 tokens: one more fits
    assert status == 200 and len(body["choices"][0]["token_ids"]) == 1
    status, body = small.gen(list(range(2, 62)), headers=AUTH, max_tokens=10, **sp)
    assert status == 200 and len(body["choices"][0]["token_ids"]) == 4
    assert body["choices"][0]["finish_reason"] == "length"
    comp = {"prompt": list(range(2, 62)), **sp}
    assert small.call("POST", "/v1/completions", {**comp, "max_tokens": 65}, AUTH)[0] == 400
    status, body = small.call("POST", "/v1/completions", {**comp, "max_tokens": 64}, AUTH)
    assert status == 200
    assert body["usage"]["completion_tokens"] == 4 and body["choices"][0]["finish_reason"] == "length"
    status, body = small.call("POST", "/v1/completions", {"prompt": [5, 6], **sp}, AUTH)
    assert body["usage"]["completion_tokens"] == 16  # default max_tokens


def test_api_key_guards_every_route_but_health(small):
    status, body = small.call("GET", "/v1/models")
    assert (status, body) == (401, {"error": "Unauthorized"})
    assert small.gen(PROMPT, top_k=5, max_tokens=1)[0] == 401
    assert small.call("GET", "/v1/models", headers=AUTH)[0] == 200
    assert small.call("GET", "/health")[0] == 200 and small.call("GET", "/is_paused")[0] == 401
    assert small.call("POST", "/pause?mode=keep")[0] == 401 and small.call("GET", "/metrics")[0] == 401
    status, info = small.call("GET", "/server_info?config_format=json", headers=AUTH)
    assert status == 200 and info["vllm_config"]["model_config"]["return_sampling_mask"] is False
    assert info["vllm_config"]["scheduler_config"]["async_scheduling"] is False  # the default on CPU
    # without the mask flag greedy and top_k-free requests are fine, and no masks come back
    status, body = small.gen(PROMPT, headers=AUTH, temperature=0.0, max_tokens=3, ignore_eos=True)
    assert status == 200 and body["choices"][0]["sampling_mask"] is None


def test_preemption_keeps_outputs_identical(small, hf_model):
    """A 128-token cache cannot hold 4 sequences of 40 tokens: the youngest are preempted and
    re-prefilled, and seeds keyed on output positions give the same tokens as sequential runs."""
    sp = {"temperature": 1.0, "top_k": 30, "max_tokens": 30, "ignore_eos": True, "logprobs": 2}
    prompts = [[3 + i, 8, 9, 10, 11, 12, 13, 14, 15, 16] for i in range(4)]
    before = _metric(small, "vllm:num_preemptions_total")
    with ThreadPoolExecutor(4) as pool:
        batched = list(pool.map(lambda i: small.gen(prompts[i], headers=AUTH, seed=i, **sp), range(4)))
    assert _metric(small, "vllm:num_preemptions_total") > before
    for i, (status, body) in enumerate(batched):
        assert status == 200
        alone = small.gen(prompts[i], headers=AUTH, seed=i, **sp)[1]
        assert body["choices"][0]["token_ids"] == alone["choices"][0]["token_ids"]
        _check_against_reference(hf_model, prompts[i], body["choices"][0], sp)


# --- prefix caching -------------------------------------------------------------------------------


def _prefix_counters(server) -> tuple[float, float]:
    return _metric(server, "vllm:prefix_cache_queries_total"), _metric(server, "vllm:prefix_cache_hits_total")


def test_groups_and_next_turns_reuse_cached_prefixes_with_exact_logprobs(main, hf_model):
    info = main.call("GET", "/server_info?config_format=json")[1]
    assert info["vllm_config"]["cache_config"]["enable_prefix_caching"] is True
    sp = {"temperature": 1.0, "top_k": 20, "logprobs": 5}
    prompt = list(range(20, 60))  # 2 full blocks + 8 tokens, used by no other test
    queries, hits = _prefix_counters(main)
    status, body = main.gen(prompt, max_tokens=10, seed=3, ignore_eos=True, n=4, **sp)
    assert status == 200, body
    for choice in body["choices"]:  # one group: the 3 later children share the first one's blocks
        _check_against_reference(hf_model, prompt, choice, sp)
    assert _prefix_counters(main) == (queries + 4 * 40, hits + 3 * 32)
    # the next turn of a conversation: the whole first request plus new tokens
    turn2 = prompt + body["choices"][0]["token_ids"] + [7, 8, 9, 10, 11]
    status, body = main.gen(turn2, max_tokens=10, seed=4, ignore_eos=True, **sp)
    _check_against_reference(hf_model, turn2, body["choices"][0], sp)
    assert _prefix_counters(main)[1] == hits + 3 * 32 + 48  # 49 tokens with KV: 3 whole blocks


def test_reset_prefix_cache_forgets_prompts_and_fails_while_blocks_are_held(main):
    prompt = list(range(100, 140))
    assert main.gen(prompt, top_k=5, max_tokens=2, seed=0)[0] == 200
    assert main.call("POST", "/reset_prefix_cache") == (200, {"success": True})
    hits = _prefix_counters(main)[1]
    assert main.gen(prompt, top_k=5, max_tokens=2, seed=0)[0] == 200
    assert _prefix_counters(main)[1] == hits
    reference = main.gen(PROMPT, top_k=20, seed=9, max_tokens=220, ignore_eos=True, logprobs=0)[1]
    pool, fut = _start_long_request(main)
    assert main.call("POST", "/reset_prefix_cache") == (200, {"success": False})
    assert main.call("POST", "/reset_prefix_cache?reset_running_requests=true") == (200, {"success": True})
    status, body = fut.result(timeout=60)  # preempted, prefilled again, same tokens
    assert status == 200 and body["choices"][0]["token_ids"] == reference["choices"][0]["token_ids"]
    pool.shutdown()


def test_weight_routes_state_machine_and_versions(main):
    def err(path, body=None):
        status, out = main.call("POST", path, body)
        assert status == 500 and out["error"]["type"] == "InternalServerError", (path, status, out)
        return out["error"]["message"]

    assert "init" in err("/start_weight_update").lower()
    assert "start" in err("/update_weights", {"update_info": {"names": [], "dtype_names": [], "shapes": []}})
    assert "start" in err("/finish_weight_update")
    assert "Invalid init_info" in err("/init_weight_transfer_engine", {"init_info": {"bogus": 1}})
    assert main.call("POST", "/update_weight_version", {"new_version": "v7"}) == (
        200, {"success": True, "new_version": "v7"})
    assert main.call("GET", "/weight_info")[1] == {"weight_version": "v7"}
    choice = main.gen(PROMPT, top_k=5, max_tokens=3, ignore_eos=True)[1]["choices"][0]
    assert choice["weight_versions"] == [{"version": "v7", "start": 0, "end": 3}]
    assert (main.call("POST", "/shutdown_weight_transfer_engine")[1]
            == {"message": "Weight transfer shut down"})
    main.call("POST", "/update_weight_version", {"new_version": "default"})


def test_weight_loader_applies_and_validates(model_dir):
    """In-process: the loader copies by checkpoint name, handles tied names and names the mismatch."""
    from transformers import AutoModelForCausalLM

    from asyncgrpo.server.weights import WeightLoader, WeightTransferError

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    loader = WeightLoader(model)
    new = torch.randn_like(model.lm_head.weight)
    loader.load("lm_head.weight", new)
    assert torch.equal(model.lm_head.weight, new)
    loader.check(["model.layers.0.self_attn.q_proj.weight"], ["float32"],
                 [list(model.model.layers[0].self_attn.q_proj.weight.shape)])
    with pytest.raises(WeightTransferError, match="unknown parameter"):
        loader.check(["model.nope"], ["float32"], [[1]])
    with pytest.raises(WeightTransferError, match="dtype bfloat16"):
        loader.check(["lm_head.weight"], ["bfloat16"], [list(new.shape)])
    with pytest.raises(WeightTransferError, match="shape"):
        loader.load("lm_head.weight", torch.zeros(2, 2))
    from transformers import Qwen3Config, Qwen3ForCausalLM

    tied = Qwen3ForCausalLM(Qwen3Config(vocab_size=32, hidden_size=16,
                                        intermediate_size=32, num_hidden_layers=1,
                                        num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                                        tie_word_embeddings=True))
    embed = torch.randn(32, 16)
    WeightLoader(tied).load("model.embed_tokens.weight", embed)
    assert torch.equal(tied.lm_head.weight, embed)
