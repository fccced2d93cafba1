"""Gated DeltaNet hybrids on tree-packed rows: the trainer's per-token log-probs (and parameter
gradients) of a packed row equal each sample forwarded alone through the model's own forward."""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from test_recurrent import plain_delta_rule  # the same folder is on the path (pytest's prepend imports)
from transformers import AutoModelForCausalLM, AutoModelForImageTextToText
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

from asyncgrpo.modeling.deltanet.layer import deltanet_layers
from asyncgrpo.modeling.support import VISION_LANGUAGE_MODEL_TYPES
from asyncgrpo.packing import Sample, check_supported, pack_row
from asyncgrpo.packing.attention import (
    TreeMask,
    disable_tree_attention,
    enable_tree_attention,
    tree_attention_context,
)
from asyncgrpo.train.model_setup import hidden_states_and_head

pytestmark = pytest.mark.engine

VOCAB = 96
_TEXT = {"vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 3,
         "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "max_position_embeddings": 512,
         "attention_dropout": 0.0, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
         "linear_key_head_dim": 8, "linear_value_head_dim": 8, "linear_conv_kernel_dim": 4,
         "layer_types": ["linear_attention", "full_attention", "linear_attention"]}
_MOE = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16,
        "shared_expert_intermediate_size": 16}
HYBRIDS = {
    "qwen3_5_text": {},
    "qwen3_5_moe_text": _MOE,
    "qwen3_next": {**_MOE, "decoder_sparse_step": 1, "mlp_only_layers": []},
}
_VISION = {"depth": 1, "hidden_size": 16, "intermediate_size": 32, "num_heads": 2, "out_hidden_size": 32,
           "patch_size": 4, "spatial_merge_size": 2, "temporal_patch_size": 2, "num_position_embeddings": 16}


def tiny_hybrid(model_type: str, dtype=torch.float32, seed: int = 0):
    config = CONFIG_MAPPING[model_type](**_TEXT, **HYBRIDS[model_type])
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, attn_implementation="eager",
                                            experts_implementation="eager"
                                            ).to(dtype).eval()


def tiny_vision_language(model_type: str, dtype=torch.float32, seed: int = 0):
    """A tiny random checkpoint of a vision-language family: hybrid text for Qwen3.5, MoE text for
    the MoE families, a one-block vision tower."""
    text = dict(_TEXT, **(_MOE if model_type.endswith("_moe") else {}))
    vision = dict(_VISION)
    if model_type.startswith("qwen3_vl"):
        text = {k: v for k, v in text.items() if not k.startswith("linear_") and k != "layer_types"}
        text["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [1, 1, 2],
                                   "mrope_interleaved": True}
        vision["deepstack_visual_indexes"] = [0]
    config = CONFIG_MAPPING[model_type](text_config=text, vision_config=vision)
    torch.manual_seed(seed)
    return AutoModelForImageTextToText.from_config(config, attn_implementation="eager",
                                                   experts_implementation="eager").to(dtype).eval()


def hybrid_samples(rng: np.random.Generator) -> list[Sample]:
    """GRPO groups sharing a prompt, completions longer than a 64-token chunk, multi-turn branches
    (a later turn extends an earlier sample, two turns fork from one), forks at several depths
    (one-token segments, segments shorter than the conv window), a duplicate, an unshared sample."""
    def tokens(n):
        return [int(t) for t in rng.integers(0, VOCAB, n)]

    samples: list[Sample] = []

    def add(context, completion, group):
        ids = list(context) + list(completion)
        mask = [False] * len(context) + [True] * len(completion)
        samples.append(Sample(ids, mask, [float(-rng.random()) if m else 0.0 for m in mask],
                              float(rng.normal()), group))

    system = tokens(4)
    for group in range(2):
        prompt = system + tokens(3)
        completions = [tokens(n) for n in (70, 9, 1, 130)]
        for c in completions:
            add(prompt, c, group)
        first = prompt + completions[0]
        add(first + tokens(2), tokens(5), group)  # turn 2 of the first rollout
        add(first + tokens(2), tokens(66), group)  # another turn 2: a fork inside the turn's context
        add(prompt, completions[1], group)  # a duplicate
        add(prompt[:1], tokens(3), group)  # forks after the first token
        add(prompt[:2], tokens(1), group)  # and after the second: a one-token segment between forks
    add(tokens(2), tokens(12), 9)  # shares nothing
    return samples


def unpacked_logprobs(model, samples: list[Sample]) -> torch.Tensor:
    out = []
    with torch.no_grad():
        for s in samples:
            ids = torch.as_tensor(s.token_ids, dtype=torch.long)[None]
            logits = model(input_ids=ids, use_cache=False).logits[0]
            t = torch.as_tensor(np.flatnonzero(s.trained_mask))
            out.append(torch.log_softmax(logits[t - 1], -1).gather(-1, ids[0, t, None])[:, 0])
    return torch.cat(out)


def packed_logprobs(model, samples: list[Sample]) -> torch.Tensor:
    """The trainer's path: hidden states of the row through the model, log-probs at trained tokens."""
    row = pack_row(samples)
    with torch.no_grad(), tree_attention_context(TreeMask.from_row(row)):
        hidden, head, _ = hidden_states_and_head(model, row.input_ids, row.position_ids)
    logits = head(hidden[row.pred_index])
    return torch.log_softmax(logits, -1).gather(-1, row.target_ids[:, None])[:, 0]


def plain_chunk_rule(query, key, value, g, beta, chunk_size=64, initial_state=None, output_final_state=False,
                     use_qk_l2norm_in_kernel=False, **kwargs):
    """transformers' chunked delta rule replaced by the token recurrence in float64 (its own runs in
    float32 whatever the model's dtype, which would hide float64 exactness)."""
    assert initial_state is None and use_qk_l2norm_in_kernel
    outs = []
    for b in range(query.shape[0]):
        rep = value.shape[2] // query.shape[2]
        q, k = (x[b].double().repeat_interleave(rep, dim=1) for x in (query, key))
        outs.append(plain_delta_rule(q, k, value[b].double(), g[b].double(), beta[b].double())[0])
    return torch.stack(outs).to(query.dtype), None


@pytest.fixture
def float64_reference(monkeypatch):
    """Makes `model`'s unpacked forward run its delta rule in float64."""
    def patch(model):
        for layer in deltanet_layers(model):
            monkeypatch.setattr(sys.modules[type(layer).__module__],
                                "torch_chunk_gated_delta_rule", plain_chunk_rule)
    return patch


def check_tree_shape(samples):
    row = pack_row(samples)
    assert row.num_tokens < row.num_raw_tokens
    lengths = row.segment_len.tolist()
    assert max(lengths) > 64 and min(lengths) == 1 and sorted(lengths)[1] < 3


@pytest.mark.parametrize("model_type", sorted(HYBRIDS))
def test_packed_logprobs_equal_unpacked_in_float64(model_type, float64_reference):
    model = tiny_hybrid(model_type, torch.float64)
    samples = hybrid_samples(np.random.default_rng(1))
    check_tree_shape(samples)
    float64_reference(model)
    reference = unpacked_logprobs(model, samples)
    enable_tree_attention(model)
    packed = packed_logprobs(model, samples)
    # the layers' own float32 norms and gates bound float64 agreement (3e-8 measured); a segment
    # starting from zeros instead of its parent's state, or a conv window reaching a row neighbour,
    # moves these log-probs by 2e-4 to 2e-3 in this tiny random model
    torch.testing.assert_close(packed, reference, atol=2e-7, rtol=0)


@pytest.mark.parametrize("model_type", sorted(HYBRIDS))
def test_packed_logprobs_equal_unpacked_in_float32(model_type):
    model = tiny_hybrid(model_type)
    samples = hybrid_samples(np.random.default_rng(2))
    reference = unpacked_logprobs(model, samples)  # transformers' own chunked delta rule
    enable_tree_attention(model)
    torch.testing.assert_close(packed_logprobs(model, samples), reference, atol=1e-5, rtol=0)  # 1e-6 measured


@pytest.mark.parametrize("model_type", [t if t == "qwen3_next" else pytest.param(t, marks=pytest.mark.slow)
                                        for t in sorted(HYBRIDS)])  # one family in the quick suite
def test_packed_parameter_gradients_equal_unpacked_with_checkpointing(model_type, float64_reference):
    model = tiny_hybrid(model_type, torch.float64, seed=3)
    float64_reference(model)
    samples = hybrid_samples(np.random.default_rng(3))
    model.train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})

    loss = 0
    for s in samples:
        ids = torch.as_tensor(s.token_ids, dtype=torch.long)[None]
        t = torch.as_tensor(np.flatnonzero(s.trained_mask))
        lp = torch.log_softmax(model(input_ids=ids, use_cache=False).logits[0, t - 1], -1).gather(
            -1, ids[0, t, None])
        loss = loss + s.advantage * lp.sum()
    loss.backward()
    reference = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()

    enable_tree_attention(model)
    row = pack_row(samples)
    with tree_attention_context(TreeMask.from_row(row)):
        hidden, head, _ = hidden_states_and_head(model, row.input_ids, row.position_ids)
    lp = torch.log_softmax(head(hidden[row.pred_index]), -1).gather(-1, row.target_ids[:, None])[:, 0]
    (lp * row.advantages.double()).sum().backward()  # outside the context: recomputation reads the kwargs
    packed = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert packed.keys() == reference.keys()
    assert any("linear_attn.A_log" in n for n in packed)
    for name, grad in reference.items():
        torch.testing.assert_close(packed[name], grad, atol=1e-6 * max(1.0, float(grad.abs().max())), rtol=0,
                                   msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("model_type", sorted(VISION_LANGUAGE_MODEL_TYPES))
def test_vision_language_text_model_packed_equals_unpacked(model_type, float64_reference):
    model = tiny_vision_language(model_type, torch.float64)
    check_supported(model.config)
    float64_reference(model)
    samples = hybrid_samples(np.random.default_rng(4))
    reference = unpacked_logprobs(model, samples)
    enable_tree_attention(model)
    torch.testing.assert_close(packed_logprobs(model, samples), reference, atol=2e-7, rtol=0)


def test_without_a_row_the_layers_run_their_own_forward():
    model = tiny_hybrid("qwen3_5_text")
    ids = torch.randint(0, VOCAB, (2, 20))
    with torch.no_grad():
        before = model(input_ids=ids).logits
        enable_tree_attention(model)
        disable_tree_attention(model, "eager")
        after = model(input_ids=ids).logits
    torch.testing.assert_close(after, before, atol=0, rtol=0)
    assert all("_asyncgrpo_original_forward" not in vars(layer) for layer in deltanet_layers(model))


def test_a_layer_called_without_the_row_during_a_packed_forward_says_what_to_upgrade():
    model = tiny_hybrid("qwen3_next")
    enable_tree_attention(model)
    row = pack_row(hybrid_samples(np.random.default_rng(5))[:3])
    layer = deltanet_layers(model)[0]
    with tree_attention_context(TreeMask.from_row(row)), \
            pytest.raises(RuntimeError, match="transformers >= 5.15"):
        layer(hidden_states=torch.zeros(1, row.num_tokens, 32))


def test_a_hybrid_with_other_linear_layers_is_refused_by_name():
    for model_type in ("kimi_linear", "olmo3_2_hybrid"):
        if model_type in CONFIG_MAPPING:
            with pytest.raises(ValueError, match="not been verified"):
                check_supported(CONFIG_MAPPING[model_type]())
    config = CONFIG_MAPPING["qwen3"](layer_types=["full_attention", "linear_attention"], num_hidden_layers=2)
    with pytest.raises(ValueError, match="linear_attention"):
        check_supported(config)


def test_an_unverified_vision_language_model_is_refused_naming_its_text_model():
    with pytest.raises(ValueError, match="multimodal model that tree packing has not been "
                                         "verified.*'gemma3_text'"):
        check_supported(CONFIG_MAPPING["gemma3"]())


def test_hub_kernels_never_take_the_packed_forward_back():
    """transformers >= 5.2x turns hub kernels on where the `kernels` package is installed, and each
    train()/eval() then re-kernelizes the layers it decorates, the Gated DeltaNet among them, putting
    their own forward back: without a guard, training would mix the packed samples' recurrent states."""
    model = tiny_hybrid("qwen3_5_text")
    if not hasattr(model, "set_use_kernels"):
        pytest.skip("this transformers has no hub kernels")
    pytest.importorskip("kernels")
    samples = hybrid_samples(np.random.default_rng(5))
    reference = unpacked_logprobs(model, samples)
    model.set_use_kernels(True)  # what from_pretrained does by default there
    enable_tree_attention(model)
    assert not model.use_kernels
    model.train()  # as the Trainer does before its first step
    torch.testing.assert_close(packed_logprobs(model, samples), reference, atol=2e-5, rtol=0)
    model.eval()
    torch.testing.assert_close(packed_logprobs(model, samples), reference, atol=2e-5, rtol=0)
