"""train/lora_sync.py's adapter folder (`write_adapter`), without a server."""

from __future__ import annotations

import json

import pytest
import torch

from asyncgrpo.train.lora_sync import write_adapter

peft = pytest.importorskip("peft")


def _tiny():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64)
    return Qwen3ForCausalLM(config).eval()


def test_the_folder_holds_the_active_adapter_in_the_serving_dtype_and_replaces_an_older_one(tmp_path):
    from safetensors.torch import load_file

    model = peft.get_peft_model(_tiny(), peft.LoraConfig(r=4, target_modules=["q_proj"], init_lora_weights=False))
    model.add_adapter("other", peft.LoraConfig(r=8, lora_alpha=3, target_modules=["down_proj"],
                                               init_lora_weights=False))
    folder = tmp_path / "v0"
    folder.mkdir()
    (folder / "stale.bin").write_text("an older write")
    for name, rank, module in (("default", 4, "q_proj"), ("other", 8, "down_proj")):
        model.set_adapter(name)
        size = write_adapter(model, folder, torch.bfloat16)
        assert sorted(p.name for p in folder.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
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
