"""Tree attention: packed per-token log-probs equal unpacked ones, block masks match the rule."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
import torch.nn.functional as F

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from torch.nn.attention.flex_attention import create_mask
from transformers import AutoModelForCausalLM
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

from asyncgrpo.packing import SUPPORTED_MODEL_TYPES, Sample, check_supported, pack_row
from asyncgrpo.packing.attention import (
    TreeMask,
    disable_tree_attention,
    enable_tree_attention,
    tree_attention_context,
)
from asyncgrpo.train.logprobs import token_logprobs
from asyncgrpo.train.model_setup import hidden_states_and_head, logit_processing

pytestmark = pytest.mark.engine

VOCAB = 96
WINDOW = 6  # shorter than the samples, so sliding layers really slide

# Tiny configs: 2 layers; sliding-window models get one sliding and one full layer.
_COMMON = {"vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
           "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "max_position_embeddings": 256,
           "attention_dropout": 0.0}
_SLIDING = {"sliding_window": WINDOW, "layer_types": ["sliding_attention", "full_attention"]}
_EXTRA: dict[str, dict] = {
    "qwen3": dict(_SLIDING, use_sliding_window=True, max_window_layers=1),
    "qwen2": dict(_SLIDING, use_sliding_window=True, max_window_layers=1),
    "mistral": {"sliding_window": WINDOW},
    "ministral": dict(_SLIDING),
    "phi3": {"sliding_window": WINDOW, "pad_token_id": 0},
    "gemma2": dict(_SLIDING, attn_logit_softcapping=5.0, final_logit_softcapping=10.0,
                   query_pre_attn_scalar=8),
    "gemma3_text": dict(_SLIDING, query_pre_attn_scalar=8),
    "exaone4": dict(_SLIDING),
    "olmo3": dict(_SLIDING),
    "smollm3": {"no_rope_layers": [1, 0], "pad_token_id": 0},
    "starcoder2": {"sliding_window": WINDOW},
    "qwen3_moe": {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16,
                  "decoder_sparse_step": 1, "mlp_only_layers": []},
    "qwen2_moe": dict(_SLIDING, use_sliding_window=True, max_window_layers=1, num_experts=4,
                      num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=16),
    "glm4": {"partial_rotary_factor": 0.5, "pad_token_id": 0},
    "granite": {"logits_scaling": 4.0},  # the model divides its logits by this
    "cohere2": dict(_SLIDING, logit_scale=0.25),  # the model multiplies its logits by this
}
# Gated DeltaNet hybrids: one linear-attention and one full-attention layer
# (tests/packing/test_tree_deltanet.py covers them in depth: float64, long segments, gradients,
# vision-language checkpoints)
_DELTANET = {"linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 8,
             "linear_value_head_dim": 8, "layer_types": ["linear_attention", "full_attention"]}
_HYBRID_MOE = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16,
               "shared_expert_intermediate_size": 16}
_EXTRA.update({
    "qwen3_5_text": _DELTANET,
    "qwen3_5_moe_text": {**_DELTANET, **_HYBRID_MOE},
    "qwen3_next": {**_DELTANET, **_HYBRID_MOE, "decoder_sparse_step": 1, "mlp_only_layers": []},
})


def tiny_model(model_type: str, seed: int = 0, **overrides):
    config = CONFIG_MAPPING[model_type](**{**_COMMON, **_EXTRA.get(model_type, {}), **overrides})
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    return model


def grpo_like_samples(rng: np.random.Generator) -> list[Sample]:
    """Groups with a shared system prompt, forks (a turn extending another sample), duplicates."""
    system = list(rng.integers(0, VOCAB, 5))
    samples: list[Sample] = []
    for group in range(3):
        prompt = system + list(rng.integers(0, VOCAB, int(rng.integers(2, 6))))
        outputs = []
        for _ in range(3):
            completion = list(rng.integers(0, VOCAB, int(rng.integers(1, 12))))
            outputs.append(completion)
            samples.append(_sample(prompt, completion, group, rng))
        # a fork: the next turn's prompt starts with a whole earlier sample
        first = prompt + outputs[0]
        samples.append(_sample(first + list(rng.integers(0, VOCAB, 3)),
                               list(rng.integers(0, VOCAB, 4)), group, rng))
        # an exact duplicate: its tokens are shared, its trained tokens are kept
        samples.append(_sample(prompt, outputs[1], group, rng))
        # diverges right after the prompt's first token
        samples.append(_sample(prompt[:1], list(rng.integers(0, VOCAB, 6)), group, rng))
    return samples


def _sample(context: list[int], completion: list[int], group: int, rng: np.random.Generator) -> Sample:
    tokens = list(context) + list(completion)
    mask = [False] * len(context) + [True] * len(completion)
    logprobs = [float(-rng.random()) if m else 0.0 for m in mask]
    return Sample(tokens, mask, logprobs, float(rng.normal()), group)


def unpacked_logprobs(model, samples: list[Sample]) -> torch.Tensor:
    """Reference: each sample forwarded alone with the model's own (eager) attention."""
    out = []
    with torch.no_grad():
        for s in samples:
            ids = torch.as_tensor(s.token_ids, dtype=torch.long)[None]
            logits = model(input_ids=ids).logits[0].float()
            t = torch.as_tensor(np.flatnonzero(s.trained_mask))
            out.append(torch.log_softmax(logits[t - 1], -1).gather(-1, ids[0, t, None])[:, 0])
    return torch.cat(out)


def packed_logprobs(model, samples: list[Sample], backend: str = "dense") -> torch.Tensor:
    """The trainer's log-probs of a packed row: body hidden states, then the LM head and the model's
    own logit processing (scale, softcap) at the trained positions only."""
    row = pack_row(samples)
    with torch.no_grad(), tree_attention_context(TreeMask.from_row(row, backend=backend)):
        hidden, head, _ = hidden_states_and_head(model, row.input_ids, row.position_ids)
        logps = token_logprobs(hidden, head.weight, row.pred_index, row.target_ids,
                               lm_head_bias=head.bias, **logit_processing(model.config))
    return logps.target_logprobs


@pytest.mark.parametrize("model_type", sorted(SUPPORTED_MODEL_TYPES))
def test_packed_logprobs_equal_unpacked(model_type):
    model = tiny_model(model_type)
    samples = grpo_like_samples(np.random.default_rng(1))
    reference = unpacked_logprobs(model, samples)  # the model's own forward().logits
    enable_tree_attention(model)
    packed = packed_logprobs(model, samples)
    row = pack_row(samples)
    assert row.num_tokens < row.num_raw_tokens  # something was shared
    assert packed.shape == reference.shape
    torch.testing.assert_close(packed, reference, atol=1e-5, rtol=0)


def test_flex_backend_matches_dense_on_cpu():
    """FlexAttention (eager on CPU, forward only) runs the same mask_mod and block mask as CUDA."""
    model = tiny_model("gemma2")  # sliding window + softcapping
    samples = grpo_like_samples(np.random.default_rng(2))
    reference = unpacked_logprobs(model, samples)
    enable_tree_attention(model)
    torch.testing.assert_close(packed_logprobs(model, samples, backend="flex"), reference, atol=1e-5, rtol=0)


def test_a_masks_kernel_options_reach_flex_attention():
    """TreeMask.kernel_options travel to FlexAttention itself (it refuses an unknown backend by name);
    a mask without them gives the dense result."""
    model = tiny_model("qwen3")
    samples = grpo_like_samples(np.random.default_rng(2))
    reference = unpacked_logprobs(model, samples)
    enable_tree_attention(model)
    row = pack_row(samples)
    mask = TreeMask.from_row(row, backend="flex", kernel_options={"BACKEND": "NO_SUCH_BACKEND"})
    with pytest.raises(ValueError, match="NO_SUCH_BACKEND"), torch.no_grad(), tree_attention_context(mask):
        hidden_states_and_head(model, row.input_ids, row.position_ids)
    torch.testing.assert_close(packed_logprobs(model, samples, backend="flex"), reference, atol=1e-5, rtol=0)


def test_checkpointing_recomputes_under_the_masks_kernel_options(monkeypatch):
    """Activation checkpointing runs the forward again inside backward, wherever backward runs: the
    recomputation must use the same FlexAttention kernels as the forward, so the options travel with
    the mask. (With them in a context around the forward only, a FlashAttention-4 forward was
    recomputed on the Triton kernels and the gradients were wrong, on an H100.)"""
    from asyncgrpo.packing import attention

    seen = []

    def recording_flex_attention(query, key, value, *, block_mask, scale=None,
                                 enable_gqa=False, kernel_options=None,
                                 **kwargs):  # FlexAttention has no backward on CPU: its mask through SDPA
        seen.append(kernel_options)
        length = query.shape[2]
        dense = create_mask(block_mask.mask_mod, None, None, length, length, device=query.device)
        return F.scaled_dot_product_attention(query, key, value, attn_mask=dense,
                                              scale=scale, enable_gqa=enable_gqa)

    monkeypatch.setattr(attention, "flex_attention", recording_flex_attention)
    model = tiny_model("qwen3")
    model.train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    enable_tree_attention(model)
    row = pack_row(grpo_like_samples(np.random.default_rng(3)))
    options = {"PRESCALE_QK": False}  # a real FlexAttention option that changes nothing here
    with tree_attention_context(TreeMask.from_row(row, backend="flex", kernel_options=options)):
        hidden = model.model(input_ids=row.input_ids[None],
                             position_ids=row.position_ids[None]).last_hidden_state
    forward_calls = len(seen)
    hidden.float().pow(2).sum().backward()  # outside the context
    assert forward_calls == model.config.num_hidden_layers
    assert len(seen) == 2 * forward_calls, "backward recomputed no layer: checkpointing is off"
    assert seen == [options] * len(seen)


def test_gradients_flow_through_dense_tree_attention_with_checkpointing():
    """Backward recomputation happens outside the context: the row must travel with the kwargs."""
    model = tiny_model("qwen3")
    samples = grpo_like_samples(np.random.default_rng(3))
    row = pack_row(samples)
    model.train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    enable_tree_attention(model)
    with tree_attention_context(TreeMask.from_row(row)):  # the base model, as a chunked LM head does
        hidden = model.model(input_ids=row.input_ids[None],
                             position_ids=row.position_ids[None]).last_hidden_state
    logits = model.lm_head(hidden)[0]
    packed_loss = torch.log_softmax(logits[row.pred_index], -1).gather(-1, row.target_ids[:, None]).sum()
    packed_loss.backward()  # outside the context
    packed_grad = model.model.embed_tokens.weight.grad.clone()

    model.zero_grad()
    disable_tree_attention(model, "eager")
    loss = 0
    for s in samples:
        ids = torch.as_tensor(s.token_ids, dtype=torch.long)[None]
        t = torch.as_tensor(np.flatnonzero(s.trained_mask))
        loss = loss + torch.log_softmax(model(input_ids=ids).logits[0, t - 1], -1).gather(
            -1, ids[0, t, None]).sum()
    loss.backward()
    torch.testing.assert_close(packed_grad, model.model.embed_tokens.weight.grad, atol=1e-5, rtol=1e-4)


def test_forward_without_row_names_the_fix():
    model = tiny_model("llama")
    enable_tree_attention(model)
    with pytest.raises(RuntimeError, match="tree_attention_context"):
        model(input_ids=torch.tensor([[1, 2, 3]]))


def _dense_rule(row, window):
    seg = row.segment_ids
    parent = row.segment_parent.tolist()
    ancestors = []
    for s in range(len(parent)):
        chain, p = {s}, parent[s]
        while p >= 0:
            chain.add(p)
            p = parent[p]
        ancestors.append(chain)
    size = row.num_tokens
    dense = torch.zeros(size, size, dtype=torch.bool)
    pos = row.position_ids
    for i in range(size):
        for j in range(i + 1):
            ok = int(seg[j]) in ancestors[int(seg[i])]
            if window is not None:
                ok = ok and int(pos[i] - pos[j]) < window
            dense[i, j] = ok
    return dense


@pytest.mark.parametrize("window", [None, 5])
def test_dense_mask_is_segment_ancestry(window):
    row = pack_row(grpo_like_samples(np.random.default_rng(4)))
    torch.testing.assert_close(TreeMask.from_row(row).dense(window), _dense_rule(row, window))


@pytest.mark.parametrize("block_size,window", [(8, None), (16, None), (8, 7), (128, None)])
def test_block_mask_blocks_match_dense_rule(block_size, window):
    row = pack_row(grpo_like_samples(np.random.default_rng(5)) * 3)
    mask = TreeMask.from_row(row, backend="flex", block_size=block_size)
    dense = mask.dense(window)
    size = row.num_tokens
    nb = -(-size // block_size)
    padded = torch.zeros(nb * block_size, nb * block_size, dtype=torch.bool)
    padded[:size, :size] = dense
    valid = torch.zeros_like(padded)
    valid[:size, :size] = True
    blocks = padded.view(nb, block_size, nb, block_size)
    any_ref = blocks.any(3).any(1)
    all_ref = (blocks | ~valid.view_as(blocks)).all(3).all(1) & any_ref
    block_mask = mask.block_mask(window)
    kv_num, kv_idx = block_mask.kv_num_blocks[0, 0], block_mask.kv_indices[0, 0]
    full_num, full_idx = block_mask.full_kv_num_blocks[0, 0], block_mask.full_kv_indices[0, 0]
    partial = torch.zeros(nb, nb, dtype=torch.bool)
    full = torch.zeros(nb, nb, dtype=torch.bool)
    for q in range(nb):
        partial[q, kv_idx[q, : kv_num[q]].long()] = True
        full[q, full_idx[q, : full_num[q]].long()] = True
    assert not (partial & full).any()
    assert torch.equal((partial | full) & any_ref, any_ref)  # no visible block skipped
    assert not (full & ~all_ref).any()  # mask_mod skipped only where all pairs are visible
    if window is None:  # exact without a window
        assert torch.equal(partial | full, any_ref) and torch.equal(full, all_ref)


@pytest.mark.parametrize(
    "model_type,reason",
    [("gpt_oss", "sinks"), ("kimi_linear", "linear-attention layers"),
     ("mamba", "recurrent"), ("bloom", "ALiBi"),
     ("llama4_text", "chunked attention"), ("t5", "encoder-decoder"), ("gpt2", "not been verified")],
)
def test_unsupported_architectures_are_refused_by_name(model_type, reason):
    config = CONFIG_MAPPING[model_type]()
    if model_type == "llama4_text":
        config.attention_chunk_size = 8192
    with pytest.raises(ValueError, match=reason) as err:
        check_supported(config)
    assert repr(config.model_type) in str(err.value)


def test_attention_dropout_is_refused_with_the_fix():
    config = CONFIG_MAPPING["qwen3"](attention_dropout=0.1)
    with pytest.raises(ValueError, match="attention_dropout = 0.0"):
        check_supported(config)


def test_enable_refuses_unsupported_model():
    config = CONFIG_MAPPING["gpt2"](n_layer=1, n_embd=16, n_head=2, vocab_size=32)
    model = AutoModelForCausalLM.from_config(config)
    with pytest.raises(ValueError, match="'gpt2'"):
        enable_tree_attention(model)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "shape",
    [
        # Qwen3 heads
        {"hidden_size": 512, "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128},
        {"hidden_size": 256, "head_dim": 64},
    ],
)
def test_compiled_flex_on_cuda_matches_dense_forward_and_backward(shape):
    """The CUDA path (compiled FlexAttention, BlockMask from spans) against the dense rule in bf16,
    over rows of different lengths so the compiled kernel must follow each row's mask. A wrong mask
    moves log-probs by O(1); bf16 rounding moves them by about 1e-2."""
    model = tiny_model("qwen3", **shape).cuda().to(torch.bfloat16)
    enable_tree_attention(model)
    rng = np.random.default_rng(6)
    short = pack_row(grpo_like_samples(rng)).to("cuda")  # ~100 tokens: compiled flex failed to lower
    assert short.num_tokens < 512 and TreeMask.from_row(short).backend == "dense"
    for num_sets in (6, 12):  # rows of about 600 and 1200 tokens: five to ten 128-blocks
        row = pack_row([s for _ in range(num_sets) for s in grpo_like_samples(rng)]).to("cuda")
        results = {}
        for backend in ("dense", "flex"):
            model.zero_grad()
            with tree_attention_context(TreeMask.from_row(row, backend=backend)):
                logits = model(input_ids=row.input_ids[None], position_ids=row.position_ids[None]).logits[0]
            lp = torch.log_softmax(logits[row.pred_index].float(), -1).gather(-1, row.target_ids[:, None])
            lp.sum().backward()
            results[backend] = (lp.detach(), model.model.embed_tokens.weight.grad.float().clone())
        torch.testing.assert_close(results["flex"][0], results["dense"][0], atol=3e-2, rtol=0)
        grad = results["dense"][1]
        torch.testing.assert_close(results["flex"][1], grad, atol=3e-2 * float(grad.abs().max()), rtol=0)
