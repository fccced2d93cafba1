"""The Triton paged decode attention against a float64 reference (the gather path on upcast inputs).

    pytest -m gpu tests/gpu/test_decode_attention.py
"""

from __future__ import annotations

import pytest
import torch

from asyncgrpo.server.decode_attention import (
    decode_attention_gather,
    decode_attention_triton,
    triton_available,
    triton_works_on,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or not triton_available(), reason="needs CUDA and Triton"),
]


def _case(seed: int, batch: int, heads: int, kv_heads: int, head_dim: int, block_size: int, max_len: int, dtype):
    g = torch.Generator().manual_seed(seed)
    num_blocks = batch * (-(-max_len // block_size)) + 3
    k_pool = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g).to("cuda", dtype)
    v_pool = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g).to("cuda", dtype)
    lens = torch.randint(1, max_len + 1, (batch,), generator=g)
    lens[0] = 1  # a sequence with only its new token
    lens[-1] = max_len
    nb = -(-max_len // block_size)
    # each sequence owns distinct, shuffled blocks; entries past its length point at unrelated blocks
    tables = torch.randperm(num_blocks, generator=g)[: batch * nb].view(batch, nb)
    q = torch.randn(batch, heads, head_dim, generator=g).to("cuda", dtype)
    return q, k_pool, v_pool, tables.cuda(), lens.cuda()


@pytest.mark.parametrize(
    "dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2), (torch.float16, 3e-3)]
)
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(16, 8, 128), (4, 2, 16), (8, 1, 64), (4, 4, 32)])
@pytest.mark.parametrize("tile,num_splits", [(16, None), (64, None), (64, 1), (16, 3), (32, 16)])
def test_matches_float64_reference(dtype, tol, heads, kv_heads, head_dim, tile, num_splits):
    """num_splits None: the automatic choice (splits for the small batches); 16 splits of 32 tokens
    leave the last splits of short sequences empty."""
    for seed, (batch, block_size, max_len) in enumerate([(1, 16, 1), (5, 16, 70), (33, 4, 257), (64, 16, 384)]):
        q, k_pool, v_pool, tables, lens = _case(seed, batch, heads, kv_heads, head_dim, block_size, max_len, dtype)
        ref = decode_attention_gather(q.double(), k_pool.double(), v_pool.double(), tables, lens, head_dim**-0.5)
        out = decode_attention_triton(q, k_pool, v_pool, tables, lens, head_dim**-0.5, tile=tile,
                                      num_splits=num_splits)
        assert out.dtype == dtype and out.shape == q.shape
        assert torch.isfinite(out).all()
        err = ((out.double() - ref).norm() / ref.norm()).item()
        assert err < tol, (seed, err)


def test_strided_query_as_the_attention_layer_passes_it():
    """The layer hands q as a transposed view of [T, H, D]; the kernel reads it through its strides."""
    q, k_pool, v_pool, tables, lens = _case(7, 9, 16, 8, 128, 16, 100, torch.bfloat16)
    q_view = q.transpose(0, 1).contiguous().transpose(0, 1)  # [B, H, D] with stride(0) = D
    assert not q_view.is_contiguous()
    out = decode_attention_triton(q_view, k_pool, v_pool, tables, lens, 0.1)
    ref = decode_attention_triton(q.contiguous(), k_pool, v_pool, tables, lens, 0.1)
    torch.testing.assert_close(out, ref, rtol=0, atol=0)



def test_the_server_picks_the_kernel_on_this_gpu():
    """The load-time check (compiles, agrees with the gather) passes here, so decode steps use the kernel."""
    assert triton_works_on(torch.device("cuda", 0), torch.bfloat16)
    assert triton_works_on(torch.device("cuda", 0), torch.float16)
