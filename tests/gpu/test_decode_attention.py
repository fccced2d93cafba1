"""The Triton paged decode attention against a float64 reference (the gather path on upcast inputs).

    pytest -m gpu tests/gpu/test_decode_attention.py
"""

from __future__ import annotations

import pytest
import torch

from asyncgrpo.server.attention.base import SHARED, DecodeSegment, PlanFlags, Probe, variant_of
from asyncgrpo.server.attention.decode import TritonDecode, decode_attention_gather, triton_works_on
from asyncgrpo.server.attention.plan import ALL_VARIANTS, probe_plan
from asyncgrpo.server.attention.shared_prefix import (
    TritonSharedDecode,
    find_shared_prefixes,
    max_members,
    shared_pass_works_on,
)
from asyncgrpo.server.decode_kernels import decode_attention_triton, triton_available
from asyncgrpo.server.kv_cache import PagedKVCache

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or not triton_available(),
                       reason="needs CUDA and Triton"),
]


def _case(seed: int, batch: int, heads: int, kv_heads: int, head_dim: int,
          block_size: int, max_len: int, dtype):
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
    for seed, (batch, block_size, max_len) in enumerate([(1, 16, 1), (5, 16, 70),
                                                         (33, 4, 257), (64, 16, 384)]):
        q, k_pool, v_pool, tables, lens = _case(seed, batch, heads, kv_heads, head_dim,
                                                block_size, max_len, dtype)
        ref = decode_attention_gather(q.double(), k_pool.double(), v_pool.double(),
                                      tables, lens, head_dim**-0.5)
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
    """The load-time check (compiles, agrees with the gather) passes here for every variant (sliding
    window, soft-cap), so decode steps of every layer use the kernel."""
    for dtype in (torch.bfloat16, torch.float16):
        for windowed in (False, True):
            for capped in (False, True):
                assert triton_works_on(torch.device("cuda", 0), dtype, windowed, capped)
        for capped in (False, True):
            assert shared_pass_works_on(torch.device("cuda", 0), dtype, capped)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(16, 8, 128), (8, 4, 256), (4, 4, 32)])
@pytest.mark.parametrize("window", [None, 1, 3, 16, 100, 4096])
@pytest.mark.parametrize("softcap", [None, 30.0, 50.0])
def test_windows_and_softcaps_match_float64_reference(dtype, tol, heads, kv_heads, head_dim, window, softcap):
    """Gemma 2 (head_dim 256, window 4096, soft-cap 50), Gemma 3 and Mistral shapes; windows shorter
    than, and longer than, the contexts; the automatic splits and forced ones."""
    for seed, (batch, max_len) in enumerate([(1, 1), (5, 70), (64, 300), (256, 384)]):
        q, k_pool, v_pool, tables, lens = _case(seed, batch, heads, kv_heads, head_dim, 16, max_len, dtype)
        q = q * 8  # scores of tens: the soft-cap bites
        ref = decode_attention_gather(q.double(), k_pool.double(), v_pool.double(),
                                      tables, lens, head_dim**-0.5, window, softcap)
        for num_splits in (None, 1, 5):
            out = decode_attention_triton(q, k_pool, v_pool, tables, lens,
                                          head_dim**-0.5, num_splits=num_splits,
                                          window=window, softcap=softcap)
            assert torch.isfinite(out).all()
            err = ((out.double() - ref).norm() / ref.norm()).item()
            assert err < tol, (seed, num_splits, err)


@pytest.mark.parametrize("window,softcap", [(None, 50.0), (64, None), (64, 50.0)])
def test_the_dispatch_routes_windowed_and_capped_layers_with_groups(window, softcap):
    """A GRPO decode step's segment (groups sharing prompt blocks) through the backend the execution plan
    takes for each layer variant: soft-capped layers use the shared pass, windowed ones read their own
    blocks (the plain kernel); both equal the gather."""
    q, k_pool, v_pool, tables, lens = _group_case(0, 16, 8, 128, torch.bfloat16)
    q = q * 8
    shared = find_shared_prefixes(tables.numpy(), lens.numpy(), 16, max_members(16, 8),
                                  null_block=k_pool.shape[0] - 1)
    tables, lens = tables.cuda(), lens.cuda()
    ref = decode_attention_gather(q.double(), k_pool.double(), v_pool.double(), tables,
                                  lens, 128**-0.5, window, softcap)
    cuda = torch.device("cuda", 0)
    plan = probe_plan(Probe(cuda, torch.bfloat16, 16, 8, 128, ALL_VARIANTS, PlanFlags(shared_prefix=True),
                            max_members(16, 8)))
    backend = plan.backend(SHARED, variant_of(window, softcap))
    assert type(backend) is (TritonDecode if window is not None else TritonSharedDecode)
    segment = DecodeSegment(len(lens), tables, lens, shared.to(cuda))
    out = backend.forward(q.transpose(0, 1), None, None, k_pool, v_pool, segment, 128**-0.5, window,
                          softcap).transpose(0, 1)
    err = ((out.double() - ref).norm() / ref.norm()).item()
    assert err < 1e-2, err


def _group_case(seed: int, heads: int, kv_heads: int, head_dim: int, dtype, block_size: int = 16):
    """GRPO-shaped decode batch: groups of sequences holding the same prompt blocks (some groups behind a
    common system-prompt block), each with its own generated blocks, plus sequences of their own; in a
    shuffled batch order."""
    g = torch.Generator().manual_seed(seed)
    rows, lens, next_block = [], [], 0

    def blocks(n):
        nonlocal next_block
        next_block += n
        return list(range(next_block - n, next_block))

    system = blocks(1)
    for group in range(6):
        prompt = (system if group % 2 else []) + blocks(int(torch.randint(4, 40, (1,), generator=g)))
        for _ in range(int(torch.randint(2, 11, (1,), generator=g))):
            own = int(torch.randint(1, 6, (1,), generator=g))
            rows.append(prompt + blocks(own))
            lens.append((len(prompt) + own - 1) * block_size
                        + int(torch.randint(1, block_size + 1, (1,), generator=g)))
    for _ in range(3):
        rows.append(blocks(int(torch.randint(1, 30, (1,), generator=g))))
        lens.append(len(rows[-1]) * block_size)
    order = torch.randperm(len(rows), generator=g).tolist()
    rows, lens = [rows[i] for i in order], [lens[i] for i in order]
    width = max(map(len, rows))
    tables = torch.tensor([r + [0] * (width - len(r)) for r in rows])
    k_pool = torch.randn(next_block + 1, block_size, kv_heads, head_dim, generator=g).to("cuda", dtype)
    v_pool = torch.randn(next_block + 1, block_size, kv_heads, head_dim, generator=g).to("cuda", dtype)
    q = torch.randn(len(rows), heads, head_dim, generator=g).to("cuda", dtype)
    return q, k_pool, v_pool, tables, torch.tensor(lens)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(16, 8, 128), (32, 8, 128), (8, 1, 64), (4, 4, 32)])
@pytest.mark.parametrize("num_splits,num_shared_splits", [(None, None), (1, 1), (3, 2), (1, 7)])
def test_groups_reading_shared_blocks_once_match_float64_reference(dtype, tol, heads,
                                                                   kv_heads, head_dim, num_splits,
                                                                   num_shared_splits):
    """The shared pass (one program per group entry, kv head and split) + the own pass + the merge equal
    plain attention over each sequence's own table."""
    members = max_members(heads, kv_heads)
    for seed in range(3):
        q, k_pool, v_pool, tables, lens = _group_case(seed, heads, kv_heads, head_dim, dtype)
        shared = find_shared_prefixes(tables.numpy(), lens.numpy(), 16, members,
                                      null_block=k_pool.shape[0] - 1)
        assert shared is not None and shared.num_groups >= 3
        ref = decode_attention_gather(q.double(), k_pool.double(), v_pool.double(),
                                      tables.cuda(), lens.cuda(), head_dim**-0.5)
        out = decode_attention_triton(q, k_pool, v_pool, tables.cuda(), lens.cuda(), head_dim**-0.5,
                                      num_splits=num_splits, shared=shared.to(torch.device("cuda")),
                                      num_shared_splits=num_shared_splits)
        assert torch.isfinite(out).all()
        err = ((out.double() - ref).norm() / ref.norm()).item()
        assert err < tol, (seed, err)


def _compiled_kernels() -> int:
    """Kernels Triton has compiled so far for the decode attention's three JIT functions."""
    from asyncgrpo.server.decode_kernels import _triton_kernels

    return sum(len(binder[0]) for kernel in _triton_kernels() for binder in kernel.device_caches.values())


def test_the_kernels_compiled_at_start_serve_every_step():
    """The plan's warm-up (`ExecutionPlan.warm_up`, at load) leaves nothing to compile mid-serving: steps
    of any batch size, context width, split count and number of groups reuse its kernels."""
    heads, kv_heads, head_dim, block_size = 16, 8, 128, 16
    members = max_members(heads, kv_heads)
    g = torch.Generator().manual_seed(0)
    num_blocks = 600
    cuda = torch.device("cuda", 0)
    cache = PagedKVCache(1, num_blocks, block_size, kv_heads, head_dim, torch.bfloat16, cuda)
    k_pool, v_pool = cache.k[0], cache.v[0]
    for pool in (k_pool, v_pool):
        pool.copy_(torch.randn(pool.shape, generator=g))
    plan = probe_plan(Probe(cuda, torch.bfloat16, heads, kv_heads, head_dim, frozenset({(False, False)}),
                            PlanFlags(shared_prefix=True), members))
    plan.warm_up(cache)
    compiled = _compiled_kernels()
    for batch, prompt_blocks, group in [(1, 1, 1), (3, 5, 3), (8, 9, 8), (40, 4, 8), (64, 2, 2), (17, 30, 4)]:
        # groups of `group` sequences sharing `prompt_blocks` blocks, then one or two blocks of their own
        rows, next_block = [], 0
        for i in range(batch):
            if i % group == 0:
                prompt = list(range(next_block, next_block + prompt_blocks))
                next_block += prompt_blocks
            own = 1 + i % 2
            rows.append(prompt + list(range(next_block, next_block + own)))
            next_block += own
        width = max(map(len, rows))
        tables = torch.tensor([r + [num_blocks] * (width - len(r)) for r in rows])
        lens = torch.tensor([len(r) * block_size - 3 for r in rows])
        shared = find_shared_prefixes(tables.numpy(), lens.numpy(), block_size,
                                      members, null_block=num_blocks)
        q = torch.randn(batch, heads, head_dim, generator=g).to("cuda", torch.bfloat16)
        for num_splits in (None, 1, 5, 19):
            for groups in (None, shared):
                out = decode_attention_triton(q, k_pool, v_pool, tables.cuda(), lens.cuda(), head_dim**-0.5,
                                              num_splits=num_splits,
                                              shared=None if groups is None
                                              else groups.to(torch.device("cuda")))
                assert torch.isfinite(out).all()
    assert _compiled_kernels() == compiled
