"""The default fast paths on CUDA (`torch_compile=None`, `flex_attention_backend="auto"`): the start-up probe
passes on a tiny model in bf16, the layers stay compiled, FlashAttention-4 is picked where it runs, and the
probe's compile is what the first training row reuses (no second compile of the layers).

    pytest -m gpu tests/gpu/test_fast_paths_cuda.py
"""

from __future__ import annotations

import logging
import sys
import types
from pathlib import Path
from unittest.mock import patch

import numpy as np
import pytest
import torch
import torch._dynamo.utils

from asyncgrpo.packing import pack_row
from asyncgrpo.packing.attention import TreeMask, enable_tree_attention, tree_attention_context
from asyncgrpo.train import fast_paths
from asyncgrpo.train.compiled_layers import decoder_layers, flash_attention_problem
from asyncgrpo.train.fast_paths import choose_fast_paths
from asyncgrpo.train.logprobs import token_logprobs

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "packing"))
from test_tree_attention import grpo_like_samples, tiny_model

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


# FlexAttention's compiled kernels take head dimensions of 16 or more (test_compiled_training_step's shape)
SHAPE = {"hidden_size": 512, "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128,
         "layer_types": ["full_attention", "full_attention"], "use_sliding_window": False}
ARGS = {"device": "cuda", "torch_compile": None, "flex_attention_backend": "auto",
        "torch_compile_backend": None, "torch_compile_mode": None, "activation_memory_budget": None,
        "token_budget": 4096, "bf16": True, "fp16": False, "gradient_checkpointing": True}


def _model(**shape):
    model = tiny_model("qwen3", **shape)
    model.config.use_cache = False
    enable_tree_attention(model)
    return model


def test_the_default_compiles_on_cuda_after_the_probe_and_training_rows_reuse_its_graphs():
    model = _model(**SHAPE)
    args = types.SimpleNamespace(**ARGS)
    torch._dynamo.reset()
    paths = choose_fast_paths(model, args, fsdp=False)
    assert paths.compiled and paths.probe_s > 0, paths
    assert all(layer._compiled_call_impl is not None for layer in decoder_layers(model))
    assert (paths.flex_options is not None) == (flash_attention_problem("cuda") is None)
    print(paths.describe())
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    # as the Trainer trains: checkpointed layers in train mode (a first GPU run of this test left the
    # model in eval mode, and the layers compiled again for it)
    (getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable)()
    model.train()
    rng = np.random.default_rng(0)
    row = pack_row([s for _ in range(9) for s in grpo_like_samples(rng)]).to("cuda")
    assert row.num_tokens >= 512  # the FlexAttention path, as the probe's row
    mask = TreeMask.from_row(row, "cuda", mask_capacity=args.token_budget if paths.flex_options else None,
                             kernel_options=paths.flex_options)
    with torch.autocast("cuda", dtype=torch.bfloat16), tree_attention_context(mask):
        hidden = model.model(input_ids=row.input_ids[None],
                             position_ids=row.position_ids[None]).last_hidden_state
        lp = token_logprobs(hidden[0], model.lm_head.weight, row.pred_index, row.target_ids, fused=True)
    lp.target_logprobs.sum().backward()
    assert torch.isfinite(lp.target_logprobs).all()
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs, "the layers compiled again"


def test_a_model_the_compiled_kernels_refuse_trains_eager_with_the_reason(caplog):
    """Seen on an H100 (2026-12-07): with the tiny shapes' head dimension of 8, inductor's FlexAttention
    lowering fails in the probe. The default now knows the limit and keeps the eager layers without trying;
    forced past it, the probe's fall-back says why."""
    caplog.set_level(logging.INFO, logger="asyncgrpo.train.fast_paths")
    model = _model(**{**SHAPE, "head_dim": 8})
    torch._dynamo.reset()
    paths = choose_fast_paths(model, types.SimpleNamespace(**ARGS), fsdp=False)
    assert not paths.compiled and paths.flex_options is None
    assert "head dimension, 8" in caplog.text
    with patch.object(fast_paths, "compiled_attention_problem", lambda model: None):
        paths = choose_fast_paths(model, types.SimpleNamespace(**ARGS), fsdp=False)
    assert not paths.compiled and not any(layer._compiled_call_impl for layer in decoder_layers(model))
    assert "failed the start-up probe" in caplog.text and "at least 16" in caplog.text
