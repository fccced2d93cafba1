"""Tests for asyncgrpo.train.fast_paths: where torch_compile=None compiles, the start-up probe that checks
the compiled layers against the eager ones, and the fall-back to eager layers when it fails."""

from __future__ import annotations

import logging
import sys
import types
from pathlib import Path

import pytest
import torch
import torch._dynamo
import torch._dynamo.utils

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "packing"))
from test_tree_attention import tiny_model

from asyncgrpo.packing.attention import TreeMask, enable_tree_attention, tree_attention_context
from asyncgrpo.train.compiled_layers import decoder_layers
from asyncgrpo.train import fast_paths
from asyncgrpo.train.fast_paths import (
    PROBE_COMPLETION_TOKENS,
    PROBE_PROMPT_TOKENS,
    auto_compiles,
    choose_fast_paths,
    probe_row,
)
from asyncgrpo.train.logprobs import token_logprobs
from asyncgrpo.train.model_setup import hidden_states_and_head

pytestmark = pytest.mark.engine


def _model(head_dim=16):
    # one sliding-window and one full-attention layer; FlexAttention compiles head dimensions >= 16
    model = tiny_model("qwen3", head_dim=head_dim)
    enable_tree_attention(model)
    return model


def _args(**overrides):
    fields = {"device": "cpu", "torch_compile": None, "flex_attention_backend": "auto",
              "torch_compile_backend": "aot_eager", "torch_compile_mode": None,
              "activation_memory_budget": None,
              "token_budget": 2048, "bf16": False, "fp16": False}
    return types.SimpleNamespace(**{**fields, **overrides})


def _compiled(model) -> list[bool]:
    return [layer._compiled_call_impl is not None for layer in decoder_layers(model)]


def _scaled_outputs(factor):
    """A dynamo backend that runs the graph and scales its floating outputs: a wrong kernel."""
    def backend(gm, example_inputs):
        def run(*args):
            out = gm(*args)
            return type(out)(o * factor if torch.is_tensor(o) and o.is_floating_point() else o for o in out)
        return run
    return backend


def _failing(gm, example_inputs):
    raise RuntimeError("no kernel for this graph")


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_auto_compiles_on_one_cuda_process_only():
    assert auto_compiles(torch.device("cuda", 0), fsdp=False)
    assert not auto_compiles(torch.device("cuda", 0), fsdp=True)
    assert not auto_compiles(torch.device("cpu"), fsdp=False)


def test_the_probe_row_shares_a_prompt_long_enough_for_flex_masks():
    row = probe_row(vocab_size=151)
    assert 512 <= row.num_tokens <= PROBE_PROMPT_TOKENS + 2 * PROBE_COMPLETION_TOKENS + 1  # the prompt once
    assert row.num_trained == 2 * PROBE_COMPLETION_TOKENS
    assert int(row.input_ids.max()) < 151


def test_auto_on_cpu_keeps_the_eager_layers_and_triton_kernels():
    model = _model()
    paths = choose_fast_paths(model, _args(), fsdp=False)
    assert (paths.compiled, paths.flex_options, paths.probe_s) == (False, None, None)
    assert _compiled(model) == [False, False]


def test_auto_where_it_compiles_probes_and_keeps_compiled_layers_that_match(monkeypatch, caplog):
    monkeypatch.setattr(fast_paths, "PROBE_NOTICE_AFTER_S", 0.0)  # the long-compile notice, at once
    model = _model()
    paths = choose_fast_paths(model, _args(), fsdp=False, compiles=lambda device: True)
    assert "compiling the decoder layers and checking them against the eager ones" in caplog.text
    assert paths.compiled and paths.flex_options is None and paths.probe_s > 0
    assert _compiled(model) == [True, True]
    assert all(p.grad is None for p in model.parameters())  # the probe leaves no gradient behind
    assert "compile included" in paths.describe()
    # float32 on CPU: the compiled graphs compute what the eager layers do, to rounding
    differences = paths.probe_differences
    assert differences["logprob_max_abs"] < 1e-4 and differences["grad_cosine"] > 0.9999


def test_the_first_training_step_reuses_the_probes_graphs():
    """The probe calls the layers as training will: in train mode, and under activation checkpointing when
    the run has it (the Trainer turns it on later, in train()). Otherwise the first step compiles again
    (seen on an H100: a 20 s step 1 at 0.6B) and the probe never checked the recompute inside backward."""
    model = _model()
    model.eval()  # as loaded: the Trainer puts it in train mode
    paths = choose_fast_paths(model, _args(gradient_checkpointing=True), fsdp=False,
                              compiles=lambda device: True)
    assert paths.compiled and paths.probe_s > 0
    assert not model.is_gradient_checkpointing and not model.training  # left as it was found
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    # what the Trainer does in train() (the older transformers' name as a fallback)
    (getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable)()
    model.train()
    row = probe_row(model.config.vocab_size, seed=1)
    with tree_attention_context(TreeMask.from_row(row, "cpu")):
        hidden, head, _ = hidden_states_and_head(model, row.input_ids, row.position_ids)
        token_logprobs(hidden, head.weight, row.pred_index, row.target_ids, fused=True).target_logprobs.sum(
            ).backward()
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs, "the first step compiled again"


@pytest.mark.parametrize(("backend", "says"), [
    (_scaled_outputs(1.5), "compiled hidden differ from eager ones"),
    (_failing, "no kernel for this graph"),
])
def test_compiled_layers_that_disagree_or_fail_fall_back_to_eager_saying_why(backend, says, caplog):
    model = _model()
    with caplog.at_level(logging.WARNING, logger="asyncgrpo.train.fast_paths"):
        paths = choose_fast_paths(model, _args(torch_compile_backend=backend), fsdp=False,
                                  compiles=lambda device: True)
    assert (paths.compiled, paths.flex_options) == (False, None)
    assert _compiled(model) == [False, False]
    assert "failed the start-up probe" in caplog.text and says in caplog.text
    assert "torch_compile=False" in caplog.text


def test_an_explicit_choice_is_obeyed_without_a_probe():
    model = _model()
    paths = choose_fast_paths(model, _args(torch_compile=True, torch_compile_backend=_failing), fsdp=False)
    assert paths.compiled and paths.probe_s is None and _compiled(model) == [True, True]
    model = _model()
    paths = choose_fast_paths(model, _args(torch_compile=False), fsdp=False, compiles=lambda device: True)
    assert not paths.compiled and _compiled(model) == [False, False]


def test_flash_is_refused_where_it_cannot_run_and_auto_says_why_it_is_off():
    with pytest.raises(ValueError, match="trains on cpu: set flex_attention_backend='triton'"):
        choose_fast_paths(_model(), _args(flex_attention_backend="flash"), fsdp=False)


def test_auto_keeps_eager_layers_without_a_probe_where_the_compiled_attention_is_known_to_fail(caplog):
    """Inductor's FlexAttention refuses head dimensions below 16 (the probe saw it on an H100 with the tiny
    shapes): auto says so at info level and compiles nothing; an explicit True still compiles."""
    model = _model(head_dim=8)
    with caplog.at_level(logging.INFO, logger="asyncgrpo.train.fast_paths"):
        paths = choose_fast_paths(model, _args(torch_compile_backend=_failing), fsdp=False,
                                  compiles=lambda device: True)
    assert not paths.compiled and paths.probe_s is None and _compiled(model) == [False, False]
    assert "head dimension, 8, is below the 16" in caplog.text
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert choose_fast_paths(_model(head_dim=8), _args(torch_compile=True), fsdp=False).compiled
