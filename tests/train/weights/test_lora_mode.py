"""The start-up choice between adapter-only and merged sync, and the restart flags it names."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from asyncgrpo.generation.server_info import LoraServing, parse_server_info
from asyncgrpo.train.weights.adapters import choose_lora_sync

peft = pytest.importorskip("peft")
URL = "http://127.0.0.1:8000"
FIXTURE = Path(__file__).parents[2] / "fixtures" / "vllm" / "protocol-0.33.0.json"


def choose(lora, max_staleness=4, sharded=False, **peft_kwargs):
    config = peft.LoraConfig(**{"r": 32, "lora_alpha": 64, "target_modules": "all-linear", **peft_kwargs})
    return choose_lora_sync(lora, config, max_staleness=max_staleness, sharded=sharded, server_url=URL)


def test_a_server_with_runtime_lora_and_room_for_the_window_gets_adapter_only_sync():
    choice = choose(LoraServing(max_lora_rank=32, max_loras=6, runtime_updating=True))
    assert choice.adapter_only and "5 versions kept" in choice.reason


def test_a_server_without_lora_falls_back_to_merged_sync_and_says_how_to_enable_it():
    choice = choose(None)
    assert not choice.adapter_only
    assert "--enable-lora --max-lora-rank 32 --max-loras 6" in choice.reason


def test_vllm_without_runtime_updating_falls_back_to_merged_sync_naming_the_variable():
    choice = choose(LoraServing(32, 6, runtime_updating=False))
    assert not choice.adapter_only and "VLLM_ALLOW_RUNTIME_LORA_UPDATING=1" in choice.reason


@pytest.mark.parametrize(("peft_kwargs", "words"), [
    ({"use_dora": True}, "DoRA"),
    ({"modules_to_save": ["q_proj"]}, "modules_to_save"),
    ({"bias": "lora_only"}, "bias"),
    ({"lora_bias": True}, "lora_bias"),
    ({"init_lora_weights": "pissa"}, "init_lora_weights='pissa' also changes the base weights"),
    ({"layer_replication": [[0, 1]]}, "layer_replication"),
    ({"trainable_token_indices": [1, 2]}, "trainable_token_indices"),
    ({"target_parameters": ["mlp.experts.gate_up_proj"], "target_modules": []}, "target_parameters"),
])
def test_adapters_a_server_cannot_serve_fall_back_to_merged_sync(peft_kwargs, words):
    choice = choose(LoraServing(32, 6, True), **peft_kwargs)
    assert not choice.adapter_only and words in choice.reason


def test_an_init_that_only_sets_the_first_adapter_weights_keeps_adapter_only_sync():
    assert choose(LoraServing(32, 6, True), init_lora_weights="gaussian").adapter_only


def test_a_sharded_model_falls_back_to_merged_sync():
    assert not choose(LoraServing(32, 6, True), sharded=True).adapter_only


def test_a_rank_above_max_lora_rank_names_the_smallest_allowed_rank_that_fits():
    with pytest.raises(ValueError) as err:
        choose(LoraServing(16, 6, True), r=20)
    message = str(err.value)
    assert "--max-lora-rank 16 is below the adapter's rank 20" in message
    assert "Restart it with --enable-lora --max-lora-rank 32 --max-loras 6 " in message


def test_a_rank_pattern_counts_toward_the_rank():
    with pytest.raises(ValueError, match="--max-lora-rank 64 --max-loras 6"):
        choose(LoraServing(32, 6, True), r=8, rank_pattern={"q_proj": 40})


def test_too_few_lora_slots_for_the_staleness_window_names_max_staleness_plus_two():
    with pytest.raises(ValueError) as err:
        choose(LoraServing(32, 5, True), max_staleness=4)
    message = str(err.value)
    assert "--max-loras 5 is below max_staleness + 2 = 6" in message
    assert "Restart it with --enable-lora --max-lora-rank 32 --max-loras 6 " in message


def test_both_limits_wrong_are_reported_together_with_one_set_of_flags():
    with pytest.raises(ValueError) as err:
        choose(LoraServing(8, 1, True), max_staleness=0, r=16)
    message = str(err.value)
    assert "rank 16" in message and "max_staleness + 2 = 2" in message
    assert "--enable-lora --max-lora-rank 16 --max-loras 2 " in message


def test_a_max_lora_rank_that_vllm_does_not_accept_is_reported():
    with pytest.raises(ValueError, match="--max-lora-rank 40 is not one of 1, 8, 16, 32"):
        choose(LoraServing(40, 6, True), r=32)


def test_a_rank_above_every_allowed_max_lora_rank_says_to_train_a_smaller_one():
    with pytest.raises(ValueError, match="train with r <= 512"):
        choose(None, r=600)


def test_vllm_033_server_info_without_lora_reads_as_no_lora_and_with_lora_reads_its_limits():
    body = json.loads(FIXTURE.read_text())["server_info"]["response"]
    assert parse_server_info(body).lora is None
    body["vllm_config"]["lora_config"] = {"max_lora_rank": 32, "max_loras": 6, "max_cpu_loras": 6}
    assert parse_server_info(body).lora == LoraServing(32, 6, runtime_updating=False)
    body["vllm_env"]["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = True
    assert parse_server_info(body).lora.runtime_updating
