"""Fused attention / MLP forwards (CPU path: merged matmuls) against the Hugging Face modules.

The Triton kernels are checked on a GPU in tests/gpu/test_fused_layers.py.
"""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)
from transformers.models.qwen3 import modeling_qwen3

from asyncgrpo.server.fused_layers import FusedLayers, fuse_layers
from asyncgrpo.server.loading import load_served_model

pytestmark = pytest.mark.engine

SHAPE = {"vocab_size": 300, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2}


def _model(kind: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if kind == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(**SHAPE, head_dim=32))
    elif kind == "qwen2":  # q/k/v biases
        model = Qwen2ForCausalLM(Qwen2Config(**SHAPE))
    else:  # no q/k norms
        model = LlamaForCausalLM(LlamaConfig(**SHAPE))
    for p in model.parameters():  # non-trivial norms and biases
        if p.dim() == 1:
            torch.nn.init.normal_(p, 1.0, 0.3)
    model.config._attn_implementation = "sdpa"
    return model.eval()


@pytest.mark.parametrize("kind", ["qwen3", "qwen2", "llama"])
def test_fused_model_gives_the_same_logits(kind):
    model = _model(kind)
    fused = copy.deepcopy(model)
    assert fuse_layers(fused, triton=False) == FusedLayers(attention=2, mlp=2)
    ids = torch.randint(0, 300, (2, 11))
    with torch.no_grad():
        torch.testing.assert_close(fused(ids).logits, model(ids).logits, rtol=1e-4, atol=1e-5)


def test_weight_updates_land_in_the_fused_weights():
    """The server loads new weights with in-place copies into the parameters (WeightLoader.load)."""
    model = _model("qwen2")
    fused = copy.deepcopy(model)
    fuse_layers(fused, triton=False)
    torch.manual_seed(1)
    new = {name: torch.randn_like(p) * 0.2 for name, p in model.named_parameters()
           if any(part in name for part in ("q_proj", "k_proj", "v_proj", "up_proj", "gate_proj"))}
    fused_params = dict(fused.named_parameters())
    with torch.no_grad():
        for name, tensor in new.items():
            model.get_parameter(name).copy_(tensor)
            fused_params[name].copy_(tensor)
    ids = torch.randint(0, 300, (1, 9))
    with torch.no_grad():
        torch.testing.assert_close(fused(ids).logits, model(ids).logits, rtol=1e-4, atol=1e-5)
    # the parameters share the fused storage, so no copy of the old weights is left behind
    attn = fused.model.layers[0].self_attn
    assert attn.k_proj.weight.data_ptr() == attn.q_proj.weight.data_ptr() + attn.q_proj.weight.numel() * 4


def test_weight_deltas_land_in_the_fused_weights_and_keep_each_parameters_sketch():
    """A delta (`weight_push="delta"`) writes the changed elements into the parameters in place, as a full
    load copies into them, so the fused storage sees them too; the loader's sketch of each parameter,
    moved by the delta alone, is the sketch of what it holds."""
    from asyncgrpo.server.weights import WeightLoader
    from asyncgrpo.sync.delta import encode_delta, tensor_sketch

    model = _model("qwen2")
    fused = copy.deepcopy(model)
    fuse_layers(fused, triton=False)
    loader = WeightLoader(fused)
    g = torch.Generator().manual_seed(2)
    fused_params = dict(fused.named_parameters())
    for name, param in model.named_parameters():
        if not any(part in name for part in ("q_proj", "k_proj", "v_proj", "up_proj", "gate_proj")):
            continue
        before = loader.sketch(name)  # known before the delta: the delta moves it
        new = param.detach().clone()
        where = torch.randperm(new.numel(), generator=g)[: new.numel() // 20]
        new.view(-1)[where] += 0.5
        delta = encode_delta(fused_params[name].detach(), new)
        assert delta.num_changed == where.numel()
        loader.load_delta(name, delta)
        with torch.no_grad():
            param.copy_(new)
        assert loader.sketch(name) == tensor_sketch(new) != before, name
    ids = torch.randint(0, 300, (1, 9))
    with torch.no_grad():
        torch.testing.assert_close(fused(ids).logits, model(ids).logits, rtol=1e-4, atol=1e-5)


def test_qwen3_norm_weights_are_shared_too():
    fused = _model("qwen3")
    # CPU weights: the Triton path is never taken
    assert fuse_layers(fused, triton=True) == FusedLayers(attention=2, mlp=2, with_triton=0)
    attn = fused.model.layers[1].self_attn
    assert attn.k_norm.weight.data_ptr() == attn.q_norm.weight.data_ptr() + 32 * 4


class InterleavedRotaryAttention(modeling_qwen3.Qwen3Attention):
    """Rotates adjacent pairs (GPT-J style) instead of the two halves: another function."""

    def forward(self, hidden_states, position_embeddings, attention_mask=None, **kwargs):
        cos, sin = position_embeddings
        shape = (*hidden_states.shape[:-1], -1, self.head_dim)
        q = self.q_norm(self.q_proj(hidden_states).view(shape)).transpose(1, 2)
        k = self.k_norm(self.k_proj(hidden_states).view(shape)).transpose(1, 2)
        v = self.v_proj(hidden_states).view(shape).transpose(1, 2)

        def rotate(x):
            pairs = x.unflatten(-1, (-1, 2))
            turned = torch.stack((-pairs[..., 1], pairs[..., 0]), dim=-1).flatten(-2)
            return x * cos[:, None] + turned * sin[:, None]

        out = torch.nn.functional.scaled_dot_product_attention(rotate(q), rotate(k), v, is_causal=True,
                                                               enable_gqa=True)
        return self.o_proj(out.transpose(1, 2).reshape(*hidden_states.shape[:-1], -1)), None


def test_another_rotary_keeps_its_own_forward():
    model = _model("qwen3")
    layer = model.model.layers[0]
    other = InterleavedRotaryAttention(model.config, layer_idx=0)
    other.load_state_dict(layer.self_attn.state_dict())
    layer.self_attn = other
    reference = copy.deepcopy(model)
    assert fuse_layers(model, triton=False) == FusedLayers(attention=1, mlp=2)
    assert layer.self_attn.forward.__func__ is InterleavedRotaryAttention.forward
    ids = torch.randint(0, 300, (1, 7))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, reference(ids).logits, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_the_bundled_model_is_fused_when_served(dtype):
    """A trained model in half precision: the accuracy check accepts the merged matmuls."""
    served = load_served_model("asyncgrpo/tiny-chat", torch.device("cpu"), dtype, None)
    assert served.fused_layers == FusedLayers(attention=4, mlp=4, with_triton=0)
