"""What the embedded server refuses at load time, before it could serve a model wrongly: layer types
it does not run, linear-attention layers that are not the Gated DeltaNet layers it verified, and
multimodal families whose text model it was not verified with."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from transformers import AutoModelForCausalLM
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

from asyncgrpo.server.loading import load_served_model, prepare_model

pytestmark = pytest.mark.engine

CPU = torch.device("cpu")


def test_layers_other_than_full_attention_and_deltanet_are_refused(tmp_path):
    CONFIG_MAPPING["lfm2"](vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, full_attn_idxs=[1]).save_pretrained(tmp_path)
    with pytest.raises(ValueError,
                       match=r"layers of type \['conv'\] are not supported by the embedded server"):
        load_served_model(str(tmp_path), CPU, "float32", None)


def test_a_multimodal_family_outside_the_verified_ones_is_refused(tmp_path):
    CONFIG_MAPPING["llava"]().save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="'llava' is a multimodal model the embedded server does not serve"):
        load_served_model(str(tmp_path), CPU, "float32", None)


def test_linear_attention_layers_of_another_family_are_refused():
    config = CONFIG_MAPPING["kimi_linear"](vocab_size=64, hidden_size=32,
                                           intermediate_size=64, num_hidden_layers=2,
                                           num_attention_heads=4, num_key_value_heads=2, pad_token_id=0,
                                           bos_token_id=1, eos_token_id=2)
    assert "linear_attention" in config.layer_types
    model = AutoModelForCausalLM.from_config(config)
    with pytest.raises(ValueError, match="are Gated DeltaNet layers the embedded server runs"):
        prepare_model(model, CPU)
