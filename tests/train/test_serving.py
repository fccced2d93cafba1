"""What the trainer warns about in the server it connects to (`train/serving.py`)."""

from __future__ import annotations

import logging

import pytest
import torch

from asyncgrpo.generation.server_info import ServerInfo
from asyncgrpo.train.serving import training_dtype, warn_server_mismatches


def _info(max_model_len: int | None, dtype: str | None = "float32") -> ServerInfo:
    return ServerInfo(version="0.33.0", dialect=(0, 33, 0), model_name="m",
                      max_model_len=max_model_len, dtype=dtype,
                      logprobs_mode="processed_logprobs", supports_generate=True,
                      supports_sampling_mask=False, has_metrics=True, kv_cache_tokens=None, world_size=1)


@pytest.mark.parametrize("max_completion_length, max_model_len, warned", [
    (4096, 1024, True), (1024, 1024, True), (1023, 1024, False), (256, None, False), (None, 1024, False),
])
def test_completions_longer_than_the_servers_context_are_warned_about(caplog, max_completion_length,
                                                                      max_model_len, warned):
    with caplog.at_level(logging.WARNING, logger="asyncgrpo.train.serving"):
        warn_server_mismatches(torch.float32, max_completion_length, _info(max_model_len))
    assert (f"max_completion_length={max_completion_length} is not below the server's max_model_len"
            in caplog.text) is warned
    if warned:
        assert "--max-model-len" in caplog.text


def test_a_server_in_another_dtype_is_warned_about(caplog):
    with caplog.at_level(logging.WARNING, logger="asyncgrpo.train.serving"):
        warn_server_mismatches(torch.float32, 16, _info(1024, dtype="bfloat16"))
    assert "the server runs in bfloat16 and the trainer in float32" in caplog.text


@pytest.mark.parametrize("weights, bf16, server, warned", [
    (torch.float32, True, "bfloat16", False),   # autocast: the trainer's matmuls run in the server's dtype
    (torch.float32, False, "bfloat16", True),
    (torch.bfloat16, False, "bfloat16", False),
    (torch.bfloat16, False, "float32", True),
])
def test_the_dtype_warning_compares_the_precision_of_the_trainers_matmuls(caplog,
                                                                          weights, bf16, server, warned):
    with caplog.at_level(logging.WARNING, logger="asyncgrpo.train.serving"):
        warn_server_mismatches(training_dtype(bf16=bf16, fp16=False, weights_dtype=weights),
                               16, _info(1024, server))
    assert ("the server runs in" in caplog.text) is warned
