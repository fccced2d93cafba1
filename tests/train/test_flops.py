"""The FLOP model of perf/*_mfu against hand counts, and the MFU metrics it feeds."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import AutoModelForCausalLM
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

from asyncgrpo.metrics import MetricsWindow
from asyncgrpo.packing.tree import Sample, pack_row
from asyncgrpo.train.flops import FlopModel, peak_flops
from asyncgrpo.train.step_metrics import StepTotals

pytestmark = pytest.mark.engine

H, I, L, HEADS, KV, HD, V = 32, 64, 2, 4, 2, 8, 97


def tiny(model_type: str, **extra):
    config = CONFIG_MAPPING[model_type](vocab_size=V, hidden_size=H, intermediate_size=I, num_hidden_layers=L,
                                        num_attention_heads=HEADS,
                                        num_key_value_heads=KV, head_dim=HD, **extra)
    return AutoModelForCausalLM.from_config(config)


def test_dense_model_counts_its_layer_matmuls_head_and_attention_pairs():
    model = FlopModel.for_model(tiny("qwen3"))
    # per layer: q, k, v, o projections; gate, up, down; input/post norms (H each) and q/k norms (HD each)
    per_layer = H * HEADS * HD + 2 * H * KV * HD + HEADS * HD * H + 3 * H * I + 2 * H + 2 * HD
    assert model.layer_params == L * per_layer
    assert model.step_flops(10, 4, 55) == 6 * L * per_layer * 10 + 6 * V * H * 4 + 12 * L * HEADS * HD * 55


def test_moe_counts_only_the_active_experts():
    model = tiny("qwen3_moe", num_experts=4, num_experts_per_tok=1,
                 moe_intermediate_size=16, decoder_sparse_step=1, mlp_only_layers=[])
    flops = FlopModel.for_model(model)
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    others = sum(p.numel() for n, p in model.named_parameters() if ".layers." in n and ".experts." not in n)
    assert experts > 0 and flops.layer_params == others + experts // 4


@pytest.mark.parametrize("model_type,extra", [
    ("mistral", {"sliding_window": 8}),
    ("gemma2", {"sliding_window": 8, "layer_types": ["sliding_attention", "full_attention"]}),
])
def test_sliding_window_models_have_no_flop_model(model_type, extra):
    assert FlopModel.for_model(tiny(model_type, **extra)) is None


def test_no_peak_on_cpu_or_in_fp32():
    assert peak_flops(torch.device("cpu"), torch.bfloat16) is None
    assert peak_flops(torch.device("cuda"), torch.float32) is None


def test_mfu_is_the_steps_flops_over_the_peak_times_the_time_on_every_process():
    samples = [Sample([1, 2, 3, 4, 5], [0, 0, 1, 1, 1], [0, 0, -1, -1, -1], 1.0, 0),
               Sample([1, 2, 3, 6], [0, 0, 1, 1], [0, 0, -1, -1], -1.0, 0)]
    row = pack_row(samples)
    totals = StepTotals()
    totals.add_micro_batch(row, samples, {}, fwd_s=0.5, fwd_bwd_s=2.0)
    model = FlopModel.for_model(tiny("llama"))
    window = MetricsWindow()
    totals.record_into(window, {}, flop_model=model, peak_flops=1e9, num_processes=2)
    logged = window.reduce()
    flops = model.step_flops(row.num_tokens, row.num_trained, row.attention_pairs)
    assert logged["perf/fwd_bwd_mfu"] == pytest.approx(flops / (2.0 * 1e9 * 2))
    assert 0 < logged["perf/wall_clock_mfu"] and math.isfinite(logged["perf/wall_clock_mfu"])
    window = MetricsWindow()
    totals.record_into(window, {}, flop_model=model, peak_flops=None)
    assert "perf/fwd_bwd_mfu" not in window.reduce()


def test_a_gated_deltanet_hybrid_counts_attention_on_its_full_layers_and_the_delta_rule_per_token():
    config = CONFIG_MAPPING["qwen3_5_text"](
        vocab_size=V, hidden_size=H, intermediate_size=I, num_hidden_layers=4, num_attention_heads=HEADS,
        num_key_value_heads=KV, head_dim=HD, linear_num_key_heads=2,
        linear_num_value_heads=4, linear_key_head_dim=8,
        linear_value_head_dim=16, layer_types=["linear_attention", "linear_attention", "linear_attention",
                                                "full_attention"])
    flops = FlopModel.for_config(config, layer_params=1000)
    assert flops.attention_per_pair == 12 * 1 * HEADS * HD
    assert flops.recurrent_per_token == 3 * 4 * 6 * (64 * (2.5 * 8 + 1.5 * 16) + 3 * 8 * 16)
    assert flops.step_flops(10, 0, 0) == (6 * 1000 + flops.recurrent_per_token) * 10
