"""On the GPU, FlashAttention's variable-length kernel computes what the packed layouts' reference
computes (`server/attention/varlen.py`): prompts from token 0 and chunks after cached keys in one call,
grouped heads, a chunk of one token (the kernel drops its causal rule there), a batch of one-token chunks
only, windows shorter and longer than the chunks, the head dims of the families served; and a bf16
plan takes it by default and computes, for a group, chunked prompts and a next turn, the log-probs of
a runner that pads them.

    pytest -m gpu tests/gpu/test_varlen_attention.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from asyncgrpo.server.attention.varlen import HALF, VarlenChunks, varlen, varlen_reference, varlen_works_on

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "server"))  # the tiny models of the CPU tests
from test_scheduler_prefix_caching import Harness, _prompt, tiny_qwen3

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

TOL = {torch.float16: 2e-2, torch.bfloat16: 6e-2}


def _chunks(lens: list[int], key_lens: list[int], device: torch.device) -> VarlenChunks:
    cum = torch.tensor([[0, *np.cumsum(lens)], [0, *np.cumsum(key_lens)]], dtype=torch.int32, device=device)
    return VarlenChunks(lens, key_lens, cum[0], cum[1], None)


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("window", [None, 7, 300])
@pytest.mark.parametrize("lens,key_lens", [
    ([33, 1, 200, 17], [33, 90, 2000, 17]),  # fresh, one token after a context, a long continued chunk, fresh
    ([1, 1, 1], [5, 700, 64]),  # one-token chunks only
])
def test_flash_varlen_matches_the_reference(dtype, head_dim, window, lens, key_lens):
    cuda = torch.device("cuda")
    g = torch.Generator().manual_seed(0)
    q = torch.randn(sum(lens), 16, head_dim, generator=g).to(cuda, dtype)
    k, v = (torch.randn(sum(key_lens), 4, head_dim, generator=g).to(cuda, dtype) for _ in range(2))
    part = _chunks(lens, key_lens, cuda)
    scale = head_dim**-0.5
    got = varlen(q, k, v, part, scale, window).float()
    want = varlen_reference(q.float(), k.float(), v.float(), lens, key_lens, scale, window)
    assert float((got - want).abs().max()) <= TOL[dtype]


def test_the_check_passes_where_the_kernel_runs():
    cuda = torch.device("cuda")
    for dtype in HALF:
        assert varlen_works_on(cuda, dtype, 16, 8, 128)
        assert varlen_works_on(cuda, dtype, 32, 8, 128, windowed=True)
    assert not varlen_works_on(cuda, torch.float32, 16, 8, 128)


def test_a_bf16_runner_packs_prompts_and_computes_what_a_padding_one_computes():
    model = tiny_qwen3().to("cuda", torch.bfloat16)
    prompt = _prompt(0, 45)
    # a group (the later members after cached blocks), a longer prompt extending it (a next turn); 24 tokens
    # a step: the long ones in chunks
    work = [(prompt, seed) for seed in range(4)] + [(prompt + _prompt(1, 30), 4)]
    first_top = []
    for choice in (None, False):  # the runner's own (packed, on CUDA in bf16), padded
        h = Harness(model, caching=True, budget=24, varlen_prompts=choice,
                    device="cuda", dtype=torch.bfloat16)
        assert h.runner.plan.packed_prompts is (choice is None)
        first_top.append([sorted(s.top(0)[1]) for s in h.run(work, max_tokens=3)])
    # bf16: the two attention kernels round differently; the distributions sampled from agree
    torch.testing.assert_close(torch.tensor(first_top[0]), torch.tensor(first_top[1]), atol=0.1, rtol=0)
