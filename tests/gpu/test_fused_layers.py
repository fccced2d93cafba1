"""The fused attention / MLP Triton kernels against the Hugging Face modules they replace.

    pytest -m gpu tests/gpu/test_fused_layers.py
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch
import torch.nn.functional as F
from test_fused_norm import GemmaStyleRMSNorm  # tests/gpu is on the path (pytest's rootdir imports)
from transformers import Qwen3Config, Qwen3ForCausalLM
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm, apply_rotary_pos_emb

from asyncgrpo.server.fused_layers import FusedLayers, _triton_kernels, fuse_layers, norm_rope, silu_mul
from asyncgrpo.server.fused_norm import fuse_rms_norms
from asyncgrpo.server.loading import load_served_model

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or _triton_kernels() is None,
                       reason="needs CUDA and Triton"),
]


def _close(got: torch.Tensor, expected: torch.Tensor) -> None:
    # same arithmetic and roundings; only the order of the norm's float32 sum differs, which can move
    # a value by a rounding step (and a difference of two products by a step of the larger one)
    eps = torch.finfo(expected.dtype).eps
    torch.testing.assert_close(got, expected, rtol=2 * eps, atol=2 * eps * expected.abs().max().item())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("tokens,heads,kv_heads,head_dim", [(1, 16, 8, 128), (256, 16, 8, 128),
                                                            (7, 4, 2, 64), (9, 4, 2, 32)])
@pytest.mark.parametrize("with_norm", [True, False])
def test_norm_rope_matches_the_modules(dtype, tokens, heads, kv_heads, head_dim, with_norm):
    g = torch.Generator().manual_seed(tokens + heads + head_dim)
    qkv = (3 * torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=g)).to("cuda", dtype)
    q_norm, k_norm = (Qwen3RMSNorm(head_dim, eps=1e-6).to("cuda", dtype) for _ in range(2))
    with torch.no_grad():
        for norm in (q_norm, k_norm):
            norm.weight.copy_(1 + 0.3 * torch.randn(head_dim, generator=g))
    angles = 1000 * torch.rand(tokens, head_dim // 2, generator=g)
    angles = torch.cat([angles, angles], dim=-1).cuda()
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    q = qkv[:, : heads * head_dim].view(tokens, heads, head_dim)
    k = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
    if with_norm:
        q, k = q_norm(q), k_norm(k)
    expected_q, expected_k = apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)
    weights = torch.cat([q_norm.weight, k_norm.weight]).detach() if with_norm else None
    got_q, got_k = norm_rope(qkv, heads, kv_heads, head_dim, weights, 1e-6, cos, sin)
    _close(got_q, expected_q)
    _close(got_k, expected_k)


def test_norm_rope_writes_the_cache_rows():
    g = torch.Generator().manual_seed(3)
    tokens, heads, kv_heads, d, block_size = 5, 4, 2, 64, 16
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * d, generator=g).to("cuda", torch.bfloat16)
    angles = torch.rand(tokens, d, generator=g).cuda()
    cos, sin = angles.cos().to(torch.bfloat16), angles.sin().to(torch.bfloat16)
    pools = [torch.zeros(7, block_size, kv_heads, d, dtype=torch.bfloat16, device="cuda") for _ in range(2)]
    slots = torch.tensor([3, 17, 40, 41, 100], device="cuda")
    weights = (1 + 0.3 * torch.randn(2 * d, generator=g)).to("cuda", torch.bfloat16)
    q, k = norm_rope(qkv, heads, kv_heads, d, weights, 1e-6, cos, sin, cache=(*pools, slots))
    expected_q, expected_k = norm_rope(qkv, heads, kv_heads, d, weights, 1e-6, cos, sin)
    assert torch.equal(q, expected_q) and torch.equal(k, expected_k)
    k_rows, v_rows = (pool.view(-1, kv_heads, d) for pool in pools)
    assert torch.equal(k_rows[slots], k)
    assert torch.equal(v_rows[slots], qkv[:, (heads + kv_heads) * d :].view(tokens, kv_heads, d))
    untouched = torch.ones(k_rows.shape[0], dtype=torch.bool, device="cuda")
    untouched[slots] = False
    assert not k_rows[untouched].any() and not v_rows[untouched].any()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("tokens,width", [(1, 3072), (256, 3072), (5, 100)])
def test_silu_mul_matches_torch(dtype, tokens, width):
    g = torch.Generator().manual_seed(tokens + width)
    gate_up = (4 * torch.randn(tokens, 2 * width, generator=g)).to("cuda", dtype)
    expected = F.silu(gate_up[:, :width]) * gate_up[:, width:]
    _close(silu_mul(gate_up), expected)


def test_fused_qwen3_keeps_the_logits():
    config = Qwen3Config(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=64)
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(config).to("cuda", torch.bfloat16).eval()
    model.config._attn_implementation = "sdpa"
    for module in model.modules():
        if isinstance(module, Qwen3RMSNorm):
            torch.nn.init.normal_(module.weight, 1.0, 0.3)
    fused = copy.deepcopy(model)
    assert fuse_layers(fused, triton=True) == FusedLayers(attention=3, mlp=3, with_triton=6)
    fuse_rms_norms(fused)
    ids = torch.randint(0, 512, (2, 37), device="cuda")
    with torch.no_grad():
        ref, out = model(ids).logits.float(), fused(ids).logits.float()
    assert ((out - ref).norm() / ref.norm()).item() < 1e-2


def test_blocks_of_another_definition_keep_their_own_forward():
    """A GELU MLP and q/k norms that scale by 1 + weight: the kernels compute something else."""
    config = Qwen3Config(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=64, hidden_act="gelu")
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(config).to("cuda", torch.bfloat16).eval()
    model.config._attn_implementation = "sdpa"
    first = model.model.layers[0].self_attn
    for name in ("q_norm", "k_norm"):
        norm = GemmaStyleRMSNorm(64, eps=1e-6).to("cuda", torch.bfloat16)
        torch.nn.init.normal_(norm.weight, 0.0, 0.3)
        setattr(first, name, norm)
    reference = copy.deepcopy(model)
    assert fuse_layers(model, triton=True) == FusedLayers(attention=1, mlp=0, with_triton=1)
    assert "forward" not in first.__dict__ and "forward" not in model.model.layers[0].mlp.__dict__
    ids = torch.randint(0, 512, (1, 23), device="cuda")
    with torch.no_grad():
        ref, out = reference(ids).logits.float(), model(ids).logits.float()
    assert ((out - ref).norm() / ref.norm()).item() < 1e-2


def test_the_server_uses_the_kernels_on_this_gpu():
    served = load_served_model("asyncgrpo/tiny-chat", torch.device("cuda", 0), "bfloat16", None)
    assert served.fused_layers == FusedLayers(attention=4, mlp=4, with_triton=8)
    for layer in served.model.model.layers:
        assert isinstance(layer.self_attn.__dict__["forward"], functools.partial), layer.self_attn.forward
