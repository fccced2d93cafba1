"""Adapter-only weight sync (`asyncgrpo.train.weights.adapters`) against a real embedded server with
--enable-lora (CPU, bundled tiny model, float32 on both sides).

The reference of a synced version is the trainer's PEFT model merged (`merge_and_unload` on a copy):
a server that loads an adapter but does not apply it, applies an older version, or keeps serving the
base model fails these tests.
"""

from __future__ import annotations

import copy
import json
import logging
import math
import os
import urllib.request

import pytest
import torch
from datasets import Dataset

from asyncgrpo import AsyncGRPOConfig, AsyncGRPOTrainer
from asyncgrpo.launch import EmbeddedServer
from asyncgrpo.modeling.load import resolve_model_path
from asyncgrpo.rewards import accuracy_reward
from asyncgrpo.tasks import arithmetic
from asyncgrpo.train.weights.adapters import AdapterSync, AdapterSyncError, write_adapter

pytestmark = pytest.mark.process

os.environ.setdefault("HF_HUB_OFFLINE", "1")
peft = pytest.importorskip("peft")

TINY = "asyncgrpo/tiny-chat"
TOL = 2e-4
PROMPT = [5, 17, 42, 99, 7, 250, 31, 8, 64, 12, 300, 2, 77, 140, 9, 33, 21, 180, 6, 55]
MAX_STALENESS = 1  # two versions kept, three slots


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log = tmp_path_factory.mktemp("server") / "server.log"
    args = [
        "--enable-lora",
        "--max-lora-rank",
        "8",
        "--max-loras",
        str(MAX_STALENESS + 2),
        "--dtype",
        "float32",
        "--max-model-len",
        "256",
    ]
    with EmbeddedServer(TINY, log_path=log, extra_args=args) as s:
        yield s


def _base_model():
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(resolve_model_path(TINY), dtype=torch.float32).eval()


def _peft_model(seed: int, r: int = 4):
    torch.manual_seed(seed)
    config = peft.LoraConfig(r=r, lora_alpha=2 * r, target_modules="all-linear", init_lora_weights=False)
    return peft.get_peft_model(_base_model(), config)


def _perturb(model, seed: int) -> None:
    """A training step's worth of change, large enough to move log-probs well beyond the tolerance."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.add_(torch.randn(p.shape, generator=gen) * 0.5)


def _merged(model):
    return copy.deepcopy(model).merge_and_unload().eval()


def _get(url: str, path: str):
    with urllib.request.urlopen(url + path, timeout=60) as resp:
        return json.loads(resp.read())


def _generate(url: str, model: str | None, seed: int = 0) -> tuple[list[int], torch.Tensor]:
    body = {"token_ids": PROMPT, "sampling_params": {"max_tokens": 8, "temperature": 1.0, "seed": seed,
                                                      "logprobs": 0, "ignore_eos": True}}
    if model is not None:
        body["model"] = model
    req = urllib.request.Request(
        url + "/inference/v1/generate",
        data=json.dumps(body).encode(),
        method="POST",
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=60) as resp:
        choice = json.loads(resp.read())["choices"][0]
    return choice["token_ids"], torch.tensor([t["logprob"] for t in choice["logprobs"]["content"]])


@torch.no_grad()
def _gap(served: tuple[list[int], torch.Tensor], reference) -> float:
    tokens, logprobs = served
    logp = torch.log_softmax(reference(torch.tensor([PROMPT + tokens])).logits[0].float(), dim=-1)
    expected = logp[len(PROMPT) - 1 : -1].gather(1, torch.tensor(tokens)[:, None])[:, 0]
    return float((logprobs - expected).abs().max())


def _served_adapters(url: str) -> list[str]:
    return [c["id"] for c in _get(url, "/v1/models")["data"] if c.get("parent")]


def _sync(server, tmp_path) -> AdapterSync:
    sync = AdapterSync(
        server.url, output_dir=tmp_path, max_staleness=MAX_STALENESS, timeout_s=60, dtype=torch.float32
    )
    sync.init()
    return sync


@pytest.mark.slow
def test_each_synced_version_serves_the_merged_peft_model_and_old_versions_rotate_out(server, tmp_path):
    model, base = _peft_model(0), _base_model()
    sync = _sync(server, tmp_path)
    keep = MAX_STALENESS + 1
    try:
        references = {}
        for version in range(2 * keep + 2):
            if version:
                _perturb(model, version)
            stats = sync.push(model, version)
            references[version] = _merged(model)
            files = sorted(p.name for p in sync.folder(version).iterdir())
            assert files == ["adapter_config.json", "adapter_model.safetensors"]
            assert stats["bytes"] == sum(p.stat().st_size for p in sync.folder(version).iterdir())
            out = _generate(server.url, sync.adapter_name(version))
            assert _gap(out, references[version]) < TOL, version
            assert _gap(out, base) > 0.05, "the adapter was loaded but not applied"
            # every version of the window still serves its own weights
            for older in range(max(0, version - MAX_STALENESS), version):
                assert _gap(_generate(server.url, sync.adapter_name(older), seed=1), references[older]) < TOL
            # the window stays registered; the folders stay one window longer (vLLM may reload from them)
            window = range(max(0, version - keep + 1), version + 1)
            assert _served_adapters(server.url) == [sync.adapter_name(v) for v in window]
            on_disk = range(max(0, version - 2 * keep + 1), version + 1)
            assert sorted(p.name for p in sync.root.iterdir()) == sorted(sync.folder(v).name for v in on_disk)
        # only the adapter's weights: far smaller than the model
        model_bytes = sum(p.numel() * 4 for n, p in model.named_parameters() if "lora_" not in n)
        assert stats["bytes"] < model_bytes / 4
    finally:
        sync.close()
    assert _served_adapters(server.url) == [] and list(sync.root.iterdir()) == []


def test_a_refused_load_keeps_the_previous_version_serving_and_says_why(server, tmp_path):
    model = _peft_model(1)
    sync = _sync(server, tmp_path)
    try:
        sync.push(model, 0)
        reference = _merged(model)
        too_big = _peft_model(2, r=16)  # the server runs with --max-lora-rank 8: it refuses the load
        with pytest.raises(AdapterSyncError) as err:
            sync.push(too_big, 1)
        message = str(err.value)
        assert "did not load LoRA adapter version 1 (asyncgrpo-lora-v1" in message
        assert "LoRA rank 16 is greater than max_lora_rank 8" in message
        assert "It keeps serving version 0 (asyncgrpo-lora-v0)" in message
        assert not sync.folder(1).exists()
        assert _served_adapters(server.url) == [sync.adapter_name(0)]
        assert _gap(_generate(server.url, sync.adapter_name(0)), reference) < TOL
        # the next sync goes through once the adapter fits again
        _perturb(model, 3)
        sync.push(model, 1)
        assert _gap(_generate(server.url, sync.adapter_name(1)), _merged(model)) < TOL
    finally:
        sync.close()


def test_a_restarted_run_unloads_the_versions_an_earlier_run_left_registered(server, tmp_path):
    model = _peft_model(4)
    earlier = _sync(server, tmp_path)
    earlier.push(model, 0)
    earlier.push(model, 1)  # the earlier run dies without close()
    later = _sync(server, tmp_path)
    try:
        assert _served_adapters(server.url) == [] and list(later.root.iterdir()) == []
        later.push(model, 1)  # a resumed run reuses the version numbers
        assert _served_adapters(server.url) == [later.adapter_name(1)]
        # ... but not the paths: vLLM keys an adapter's prefix-cache blocks by its name and path
        assert later.adapter_name(1) == earlier.adapter_name(1) and later.folder(1) != earlier.folder(1)
    finally:
        later.close()


# -- the adapter folder, without a server ---------------------------------------------------------


def _tiny_qwen3():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64)
    return Qwen3ForCausalLM(config).eval()


def test_the_folder_holds_the_active_adapter_in_the_serving_dtype_and_replaces_an_older_one(tmp_path):
    from safetensors.torch import load_file

    model = peft.get_peft_model(
        _tiny_qwen3(), peft.LoraConfig(r=4, target_modules=["q_proj"], init_lora_weights=False)
    )
    model.add_adapter("other", peft.LoraConfig(r=8, lora_alpha=3, target_modules=["down_proj"],
                                               init_lora_weights=False))
    folder = tmp_path / "v0"
    folder.mkdir()
    (folder / "stale.bin").write_text("an older write")
    for name, rank, module in (("default", 4, "q_proj"), ("other", 8, "down_proj")):
        model.set_adapter(name)
        size = write_adapter(model, folder, torch.bfloat16)
        assert sorted(p.name for p in folder.iterdir()) == [
            "adapter_config.json",
            "adapter_model.safetensors",
        ]
        assert size == sum(p.stat().st_size for p in folder.iterdir())
        config = json.loads((folder / "adapter_config.json").read_text())
        assert config["r"] == rank and config["target_modules"] == [module]
        tensors = load_file(str(folder / "adapter_model.safetensors"))
        params = dict(model.named_parameters())
        assert len(tensors) == 4  # lora_A and lora_B of two layers
        for key, tensor in tensors.items():
            assert f".{module}." in key and tensor.dtype == torch.bfloat16
            own = params[key.replace(".weight", f".{name}.weight")]
            assert torch.equal(tensor, own.detach().to(torch.bfloat16))
    assert [p.name for p in tmp_path.iterdir()] == ["v0"]  # no temporary folder left beside it


# -- the trainer: the choice at start, and a short run --------------------------------------------


def _config(tmp_path, server, **overrides) -> AsyncGRPOConfig:
    kwargs = {
        "output_dir": str(tmp_path / "out"), "vllm_server_base_url": server.url, "num_generations": 4,
        "max_completion_length": 24, "learning_rate": 1e-4, "bf16": False, "use_cpu": True,
        "gradient_checkpointing": False, "save_strategy": "no", "report_to": "none", "disable_tqdm": True,
        "logging_steps": 1, "seed": 0, "max_staleness": MAX_STALENESS,
    }
    kwargs.update(overrides)
    return AsyncGRPOConfig(**kwargs)


def _lora(**kwargs):
    # random A and B: the policy differs from the base model from the first step, so rollouts served by
    # the base model instead of the adapter would show in the log-prob difference
    return peft.LoraConfig(
        **{"r": 4, "lora_alpha": 8, "target_modules": "all-linear", "init_lora_weights": False, **kwargs}
    )


def _dataset(n: int) -> Dataset:
    return Dataset.from_list(arithmetic.make_dataset(n, seed=0))


class _Watch:
    """A callback that, at each step end (before the step's own sync), lists what the server serves."""

    def __init__(self, url: str, root) -> None:
        from transformers import TrainerCallback

        self.served: list[list[str]] = []
        self.folders: list[list[str]] = []
        watch = self

        class Callback(TrainerCallback):
            def on_step_end(self, args, state, control, **kwargs):
                watch.served.append(_served_adapters(url))
                # a folder is named <adapter name>-<run id>
                watch.folders.append(sorted(p.name.rsplit("-", 1)[0] for p in root.iterdir()))

        self.callback = Callback()


@pytest.mark.slow
def test_training_with_adapter_only_sync_serves_each_version_and_rotates_them(server, tmp_path, caplog):
    config = _config(tmp_path, server, max_steps=4)
    watch = _Watch(server.url, tmp_path / "out" / ".vllm_lora")
    trainer = AsyncGRPOTrainer(
        model=TINY,
        reward_funcs=accuracy_reward,
        train_dataset=_dataset(64),
        args=config,
        peft_config=_lora(),
        callbacks=[watch.callback],
    )
    with caplog.at_level(logging.INFO, logger="asyncgrpo.train.weights"):
        trainer.train()
    assert "PEFT weight sync: adapter only" in caplog.text
    logs = [e for e in trainer.state.log_history if "loss" in e]
    assert len(logs) == 4 and all(math.isfinite(e["loss"]) for e in logs)
    # rollouts were generated by the adapter versions: at the first step every sample is version 0's,
    # and sampler and trainer agree to float32 precision (the base model, which the random adapter moved
    # far away from, would differ by far more; later steps also train samples one version behind)
    assert logs[0]["sample/staleness_max"] == 0 and logs[0]["sampling/sampling_logp_difference/max"] < 1e-3
    assert all(e["perf/weight_sync_pause_s"] == 0.0 for e in logs)
    name = "asyncgrpo-lora-v{}".format
    # before step k's sync the server holds versions k-1-max_staleness .. k-1, and their folders are on
    # disk with those of the max_staleness + 1 versions before them
    keep = MAX_STALENESS + 1
    assert watch.served == [[name(v) for v in range(max(0, k - keep), k)] for k in range(1, 5)]
    assert watch.folders == [[name(v) for v in range(max(0, k - 2 * keep), k)] for k in range(1, 5)]
    # the end of training unloads every version and removes the serving cache
    assert _served_adapters(server.url) == [] and list((tmp_path / "out" / ".vllm_lora").iterdir()) == []


def test_a_server_with_too_little_lora_room_stops_training_at_start_with_the_restart_flags(server, tmp_path):
    trainer = AsyncGRPOTrainer(
        model=TINY,
        reward_funcs=accuracy_reward,
        train_dataset=_dataset(8),
        args=_config(tmp_path, server, max_steps=1, max_staleness=2),
        peft_config=_lora(r=16),
    )
    with pytest.raises(ValueError) as err:
        trainer.train()
    message = str(err.value)
    assert "--max-lora-rank 8 is below the adapter's rank 16" in message
    assert "--max-loras 3 is below max_staleness + 2 = 4" in message
    assert "Restart it with --enable-lora --max-lora-rank 16 --max-loras 4 " in message


@pytest.fixture
def plain_server(embedded_server):
    """A server without LoRA: the pool's plain one for tests that push weights
    (tests/train/test_trainer.py trains against it too; the tiny model serves in float32 on CPU, as
    `--dtype float32` asked here before)."""
    return embedded_server(TINY, purpose="trained")


@pytest.mark.slow
def test_without_lora_on_the_server_training_falls_back_to_merged_sync(plain_server, tmp_path, caplog):
    trainer = AsyncGRPOTrainer(model=TINY, reward_funcs=accuracy_reward, train_dataset=_dataset(32),
                               args=_config(tmp_path, plain_server, max_steps=2), peft_config=_lora())
    with caplog.at_level(logging.INFO, logger="asyncgrpo.train.weights"):
        trainer.train()
    assert "PEFT weight sync: merged (the server at" in caplog.text
    assert "--enable-lora --max-lora-rank 8 --max-loras 3" in caplog.text
    logs = [e for e in trainer.state.log_history if "loss" in e]
    assert len(logs) == 2 and all(math.isfinite(e["loss"]) for e in logs)
    assert logs[0]["sampling/sampling_logp_difference/max"] < 1e-3  # the merged weights were served
    assert not (tmp_path / "out" / ".vllm_lora").exists()
