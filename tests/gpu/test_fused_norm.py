"""The one-kernel RMSNorm against Hugging Face's own RMSNorm modules, and the swap in a whole model.

    pytest -m gpu tests/gpu/test_fused_norm.py
"""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

from asyncgrpo.server.fused_norm import fuse_rms_norms, rms_norm, triton_available

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or not triton_available(),
                       reason="needs CUDA and Triton"),
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape", [(1, 1024), (256, 1024), (7, 16, 128), (3, 100)])
def test_matches_the_module(dtype, shape):
    g = torch.Generator().manual_seed(sum(shape))
    norm = Qwen3RMSNorm(shape[-1], eps=1e-6).to("cuda", dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(shape[-1], generator=g))
    x = (3 * torch.randn(shape, generator=g)).to("cuda", dtype)
    expected = norm(x)
    got = rms_norm(x, norm.weight, norm.variance_epsilon)
    assert got.dtype == expected.dtype and got.shape == expected.shape
    # same arithmetic; only the order of the float32 sum differs: at most a rounding step apart
    torch.testing.assert_close(got, expected, rtol=torch.finfo(dtype).eps, atol=1e-6)


class GemmaStyleRMSNorm(Qwen3RMSNorm):
    """Gemma's definition: scales by 1 + weight, in float32."""

    def forward(self, hidden_states):
        x = hidden_states.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return (x * (1.0 + self.weight.float())).type_as(hidden_states)


def test_swaps_every_qwen3_norm_and_keeps_the_logits():
    config = Qwen3Config(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=64)
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(config).to("cuda", torch.bfloat16).eval()
    for module in model.modules():
        if isinstance(module, Qwen3RMSNorm):
            torch.nn.init.normal_(module.weight, 1.0, 0.3)
    fused = copy.deepcopy(model)
    assert fuse_rms_norms(fused) == 4 * config.num_hidden_layers + 1  # input, post-attention, q, k; final
    ids = torch.randint(0, 512, (2, 37), device="cuda")
    with torch.no_grad():
        ref, out = model(ids).logits.float(), fused(ids).logits.float()
    assert ((out - ref).norm() / ref.norm()).item() < 1e-2


def test_a_norm_of_another_definition_keeps_its_forward():
    model = torch.nn.Sequential(GemmaStyleRMSNorm(64), Qwen3RMSNorm(64)).cuda()
    assert fuse_rms_norms(model) == 1
    assert "forward" not in vars(model[0]) and "forward" in vars(model[1])
