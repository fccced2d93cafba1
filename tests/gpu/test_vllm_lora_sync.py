"""Adapter-only sync into a real vLLM 0.33 serving LoRA adapters at run time.

Start vLLM on a GPU (this test may share it: it holds up to five bf16 copies of the model):

    VLLM_SERVER_DEV_MODE=1 VLLM_ALLOW_RUNTIME_LORA_UPDATING=1 vllm serve MODEL_DIR --port 8001 \\
        --enable-lora --max-lora-rank 32 --max-loras 4 --enable-scale-out \\
        --logprobs-mode processed_logprobs --max-model-len 1024 --gpu-memory-utilization 0.5
    ASYNCGRPO_TEST_VLLM_URL=http://127.0.0.1:8001 ASYNCGRPO_TEST_VLLM_MODEL=MODEL_DIR \\
        pytest -m gpu tests/gpu/test_vllm_lora_sync.py

(no --return-sampling-mask: it refuses the top_k=0 requests that give the full distribution.)

The trainer side is `AdapterSync` (train/weights/adapters.py): PEFT folders written here, loaded by vLLM from
disk. After each sync, for every version still registered, vLLM's log-probs of a fixed token sequence
(`prompt_logprobs`) and of the tokens it samples must equal the trainer's PEFT model of that version
merged into the weights (bf16 tolerance) and differ from the base model's; base requests must still get
the base model. An adapter that vLLM loads but does not apply, an older version served under a newer
name, or prefix-cache blocks shared between adapters would fail these checks.
"""

from __future__ import annotations

import asyncio
import copy
import json
import os
import urllib.request

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600, method="thread")]

VLLM_URL = os.environ.get("ASYNCGRPO_TEST_VLLM_URL")
VLLM_MODEL = os.environ.get("ASYNCGRPO_TEST_VLLM_MODEL")
needs_vllm = pytest.mark.skipif(
    not (VLLM_URL and VLLM_MODEL and torch.cuda.is_available()),
    reason="needs a GPU and a running vLLM with LoRA (ASYNCGRPO_TEST_VLLM_URL, ASYNCGRPO_TEST_VLLM_MODEL)",
)
peft = pytest.importorskip("peft")

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
MAX_STALENESS = 1  # two versions registered at once: routing by version is checked too
# Mean |log-prob difference| of bf16 vLLM vs the bf16 transformers reference. vLLM applies an adapter
# unmerged (x W + (x A) B, each product rounded to bf16) where the reference merges it into W: on the
# random 1.7B shape (H100, 2026-12-05) base requests were 0.046 off and adapter requests 0.049-0.067,
# while an adapter moves the log-probs by ~1.0; `to_base > 10 * own` below is what catches an adapter
# loaded but not applied.
MEAN_TOL = 0.1


def _server_info():
    from asyncgrpo.generation.client import GenerationClient

    async def detect():
        async with GenerationClient(VLLM_URL, timeout_s=120) as client:
            return await client.detect()

    return asyncio.run(detect())


def _checked_lora_config(info, rank: int):
    """A LoRA config vLLM can serve with max_staleness 1, or a failure naming the vLLM flags."""
    from asyncgrpo.train.weights.adapters import choose_lora_sync

    config = peft.LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=TARGETS, init_lora_weights=False)
    choice = choose_lora_sync(
        info.lora, config, max_staleness=MAX_STALENESS, sharded=False, server_url=VLLM_URL
    )
    if not choice.adapter_only:
        pytest.fail(f"vLLM cannot take adapter-only syncs: {choice.reason}")
    return config


def _base():
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(VLLM_MODEL, dtype=torch.bfloat16).cuda().eval()


def _set_adapter(model, seed: int, fraction: float = 2.0) -> None:
    """Random B of every LoRA module such that its delta (scaling * B @ A) has `fraction` of the base
    weight's spread, whatever the checkpoint: each version changes the model well beyond the tolerance."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    with torch.no_grad():
        for module in model.modules():
            if not hasattr(module, "lora_B") or "default" not in module.lora_B:
                continue
            a, b = module.lora_A["default"].weight, module.lora_B["default"].weight
            scaling = module.scaling["default"]
            spread = (
                fraction
                * module.base_layer.weight.float().std()
                / (scaling * a.float().std() * a.shape[0] ** 0.5)
            )
            b.copy_((torch.randn(b.shape, generator=g, device="cuda") * spread).to(b.dtype))


@torch.no_grad()
def _reference(model, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """log p(tokens[i] | prompt + tokens[:i]) under `model`."""
    ids = torch.tensor([prompt + tokens], device="cuda")
    logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
    return torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(tokens, device="cuda")[:, None])[:, 0]


def _fixed_token_logprobs(model_name: str | None, tokens: list[int]) -> torch.Tensor:
    """vLLM's log-probs of tokens[1:] given what precedes each (`prompt_logprobs`, generate route)."""
    body = {
        "token_ids": tokens,
        "sampling_params": {"max_tokens": 1, "temperature": 1.0, "top_k": 0, "seed": 0, "prompt_logprobs": 0},
    }
    if model_name is not None:
        body["model"] = model_name
    req = urllib.request.Request(
        f"{VLLM_URL}/inference/v1/generate",
        data=json.dumps(body).encode(),
        method="POST",
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=120) as resp:
        out = json.loads(resp.read())
    per_position = out.get("prompt_logprobs")
    assert per_position and len(per_position) == len(tokens), f"no prompt_logprobs in {str(out)[:500]}"
    return torch.tensor(
        [entry[str(t)]["logprob"] for entry, t in zip(per_position[1:], tokens[1:], strict=True)],
        device="cuda",
    )


def _sampled(model_name: str | None, prompts: list[list[int]]) -> list:
    from asyncgrpo.generation.client import GenerationClient
    from asyncgrpo.generation.protocol import SamplingParams

    async def run():
        async with GenerationClient(VLLM_URL, timeout_s=120) as client:
            return await asyncio.gather(*(
                client.generate(p, SamplingParams(temperature=1.0, top_k=0, max_tokens=24, ignore_eos=True,
                                                  logprobs=0, seed=i), model=model_name)
                for i, p in enumerate(prompts)
            ))

    return asyncio.run(run())


def _gaps(model_name: str | None, references: dict, fixed: list[int], prompts: list[list[int]]) -> dict:
    """Mean |served - reference| log-prob per reference model, over the fixed tokens and the sampled ones."""
    served_fixed = _fixed_token_logprobs(model_name, fixed)
    outs = _sampled(model_name, prompts)
    gaps = {}
    for key, ref in references.items():
        fixed_gap = (served_fixed - _reference(ref, fixed[:1], fixed[1:])).abs().mean()
        sampled_gap = torch.stack([
            (torch.tensor(o.logprobs, device="cuda") - _reference(ref, p, o.token_ids)).abs().mean()
            for p, o in zip(prompts, outs, strict=True)
        ]).mean()
        gaps[key] = (float(fixed_gap), float(sampled_gap))
    return gaps


def _served_adapters(prefix: str) -> list[str]:
    """The adapters vLLM lists whose names start with `prefix` (other runs may have left others)."""
    with urllib.request.urlopen(f"{VLLM_URL}/v1/models", timeout=60) as resp:
        return [
            c["id"] for c in json.loads(resp.read())["data"] if c.get("parent") and c["id"].startswith(prefix)
        ]


@needs_vllm
def test_each_adapter_version_vllm_serves_is_the_trainers_merged_peft_model(tmp_path):
    from asyncgrpo.train.weights.adapters import AdapterSync

    info = _server_info()
    config = _checked_lora_config(info, rank=min(16, info.lora.max_lora_rank if info.lora else 16))
    base = _base()
    torch.manual_seed(0)
    model = peft.get_peft_model(_base(), config)
    vocab = base.config.vocab_size
    g = torch.Generator().manual_seed(0)
    fixed = torch.randint(2, vocab, (64,), generator=g).tolist()
    prompts = [torch.randint(2, vocab, (32,), generator=g).tolist() for _ in range(4)]
    sync = AdapterSync(VLLM_URL, output_dir=tmp_path, max_staleness=MAX_STALENESS, timeout_s=120,
                       dtype=torch.bfloat16, name="asyncgrpo-gpu-test")
    sync.init()
    merged = {}
    report = []
    try:
        for version in range(3):
            _set_adapter(model, seed=version)
            stats = sync.push(model, version)
            merged[version] = copy.deepcopy(model).merge_and_unload().eval()
            merged.pop(version - MAX_STALENESS - 1, None)  # left the window: unloaded, and its memory freed
            window = sorted(merged)
            assert _served_adapters(sync.name) == [sync.adapter_name(v) for v in window]
            for served in window:  # every registered version serves its own weights, the newest and the older
                gaps = _gaps(sync.adapter_name(served), {"own": merged[served], "base": base}, fixed, prompts)
                report.append(f"v{version} sync ({stats['bytes'] / 1e6:.1f} MB, {stats['total_s']:.2f} s): "
                              f"adapter v{served} fixed/sampled gap vs own merged {gaps['own']}, vs base "
                              f"{gaps['base']}")
                print(report[-1])
                for own, to_base in zip(gaps["own"], gaps["base"], strict=True):
                    assert own < MEAN_TOL, report[-1]
                    assert to_base > 10 * own, "the adapter was loaded but not applied: " + report[-1]
            # the base model's requests still get the base model (no adapter, no adapter's cached blocks)
            gaps = _gaps(None, {"base": base, "adapter": merged[version]}, fixed, prompts)
            print(f"v{version}: base requests gap vs base {gaps['base']}, vs adapter {gaps['adapter']}")
            assert max(gaps["base"]) < MEAN_TOL and min(gaps["adapter"]) > 10 * max(gaps["base"])
    finally:
        sync.close()
    assert _served_adapters(sync.name) == []


@needs_vllm
def test_a_load_vllm_refuses_leaves_the_previous_version_serving_and_says_why(tmp_path):
    from asyncgrpo.generation.client import GenerationClient
    from asyncgrpo.generation.transport import ServerRequestError
    from asyncgrpo.train.weights.adapters import AdapterSync, AdapterSyncError

    info = _server_info()
    max_rank = info.lora.max_lora_rank if info.lora else 16
    config = _checked_lora_config(info, rank=min(8, max_rank))
    torch.manual_seed(1)
    model = peft.get_peft_model(_base(), config)
    _set_adapter(model, seed=0)
    sync = AdapterSync(VLLM_URL, output_dir=tmp_path, max_staleness=MAX_STALENESS, timeout_s=120,
                       dtype=torch.bfloat16, name="asyncgrpo-gpu-refused")
    sync.init()
    try:
        sync.push(model, 0)
        reference = copy.deepcopy(model).merge_and_unload().eval()
        # a rank above --max-lora-rank: vLLM's engine refuses it (500 InternalServerError)
        model.add_adapter("too_big", peft.LoraConfig(r=2 * max_rank, target_modules=["q_proj"],
                                                     init_lora_weights=False))
        model.set_adapter("too_big")
        with pytest.raises(AdapterSyncError) as err:
            sync.push(model, 1)
        model.set_adapter("default")
        message = str(err.value)
        print(message)
        assert f"LoRA rank {2 * max_rank} is greater than max_lora_rank {max_rank}" in message
        assert f"It keeps serving version 0 ({sync.adapter_name(0)})" in message
        assert not sync.folder(1).exists() and _served_adapters(sync.name) == [sync.adapter_name(0)]
        g = torch.Generator().manual_seed(2)
        fixed = torch.randint(2, reference.config.vocab_size, (64,), generator=g).tolist()
        gap = _fixed_token_logprobs(sync.adapter_name(0), fixed) - _reference(reference, fixed[:1], fixed[1:])
        assert float(gap.abs().mean()) < MEAN_TOL

        async def not_found():
            async with GenerationClient(VLLM_URL, timeout_s=120) as client:
                with pytest.raises(ServerRequestError) as missing:
                    await client.load_lora_adapter("asyncgrpo-gpu-missing", str(tmp_path / "nowhere"))
                return missing.value, await client.unload_lora_adapter("asyncgrpo-gpu-missing")

        missing, unloaded = asyncio.run(not_found())
        assert missing.status == 404 and "No adapter found for" in str(missing), str(missing)
        assert unloaded is False  # 404 on unloading a name vLLM does not know
    finally:
        sync.close()
