"""KV-cache sizing from --gpu-memory-utilization (server/loading.py), vLLM's meaning: a share of the
whole GPU."""

from __future__ import annotations

import pytest

from asyncgrpo.server.loading import ModelLoadError, gpu_kv_budget_bytes, step_activation_bytes

GIB = 2**30


def test_kv_gets_the_share_less_weights_and_activations():
    assert gpu_kv_budget_bytes(140 * GIB, 0.4, 4 * GIB, 2 * GIB) == int(140 * GIB * 0.4) - 6 * GIB


def test_the_trainer_keeps_the_rest_of_the_gpu():
    total, util, weights, act = 80 * GIB, 0.35, 3 * GIB, GIB
    server_total = weights + act + gpu_kv_budget_bytes(total, util, weights, act)
    assert server_total <= total * util
    assert total - server_total >= total * (1 - util) - 1


def test_a_share_too_small_for_the_weights_says_what_to_raise():
    with pytest.raises(ModelLoadError, match="raise it, or lower --max-num-batched-tokens"):
        gpu_kv_budget_bytes(16 * GIB, 0.1, 2 * GIB, GIB)


@pytest.mark.parametrize("util", [0.0, -0.2, 1.5])
def test_utilization_outside_zero_one_is_refused(util):
    with pytest.raises(ModelLoadError, match=r"in \(0, 1\]"):
        gpu_kv_budget_bytes(16 * GIB, util, 0, 0)


def test_activation_estimate_grows_with_the_step_and_the_vocabulary():
    base = step_activation_bytes(8192, 256, 1024, 151_936, 2)
    assert step_activation_bytes(16384, 256, 1024, 151_936, 2) > base
    assert step_activation_bytes(8192, 256, 1024, 300_000, 2) > base
    assert base == 8192 * 1024 * 2 * 16 + 256 * 151_936 * 8


def test_what_the_process_held_before_loading_is_not_the_servers(monkeypatch):
    """A server inside a trainer's process (`ServerThread`) sizes its share from its own memory: the
    trainer's, reserved before the server loaded, does not shrink the KV cache."""
    import types

    import torch

    from asyncgrpo.server.kv_cache import PagedKVCache
    from asyncgrpo.server.loading import kv_cache_tokens

    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (0, 80 * GIB))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 30 * GIB)  # trainer 26, server 4
    model = torch.nn.Module()
    model.get_input_embeddings = lambda: torch.nn.Embedding(1, 64)
    served = types.SimpleNamespace(device=torch.device("cuda"),
                                   attention_layers=list(range(4)), num_kv_heads=2,
                                   head_dim=64, dtype=torch.bfloat16, max_model_len=1024,
                                   vocab_size=1000, model=model)
    per_token = PagedKVCache.bytes_per_token(4, 2, 64, torch.bfloat16)
    own = kv_cache_tokens(None, served, 100_000, 16, 0.5, 8192, reserved_before=26 * GIB)
    counted_all = kv_cache_tokens(None, served, 100_000, 16, 0.5, 8192)
    assert (own - counted_all) * per_token == pytest.approx(26 * GIB, abs=16 * per_token)
