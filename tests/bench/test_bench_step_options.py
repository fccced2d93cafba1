"""bench/step_options.py: the step variants that packing.py and profile_step.py time, and how a variant
sets up its model copy."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from step_options import SAC_BUDGET, StepOptions, prepare_model, variant_scope


def test_variants_parse_in_a_fixed_order_and_refuse_what_cannot_combine():
    assert StepOptions.parse("head+compile").name == "compile+head"
    assert StepOptions.parse("base") == StepOptions()
    assert StepOptions.parse("compile+head+sac").sac
    with pytest.raises(ValueError, match="unknown option"):
        StepOptions.parse("compile+fast")
    for option in ("tune", "flash"):
        with pytest.raises(ValueError, match=f"'{option}' is an option of the compiled layers"):
            StepOptions.parse(f"head+{option}")
    for text in ("sac", "head+sac", "compile+nockpt+sac"):
        with pytest.raises(ValueError, match="'sac' is the compiled layers' own recomputation"):
            StepOptions.parse(text)


def test_sac_runs_without_whole_layer_checkpointing_under_the_memory_budget():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    base = Qwen3ForCausalLM(config)
    options = StepOptions.parse("compile+sac")
    model = prepare_model(base, options)
    assert model is not base and not model.is_gradient_checkpointing
    assert prepare_model(base, StepOptions.parse("compile")).is_gradient_checkpointing
    before = torch._functorch.config.activation_memory_budget
    with variant_scope(options):
        assert torch._functorch.config.activation_memory_budget == SAC_BUDGET
    assert torch._functorch.config.activation_memory_budget == before
    with variant_scope(options, sac_budget=0.3):
        assert torch._functorch.config.activation_memory_budget == 0.3
    assert torch._functorch.config.activation_memory_budget == before
