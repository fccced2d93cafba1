"""On the GPU, FlashAttention's variable-length kernel computes what the packed layouts' reference
computes (`server/varlen_attention.py`): prompts from token 0 and chunks after cached keys in one call,
grouped heads, a chunk of one token (the kernel drops its causal rule there), a batch of one-token chunks
only, windows shorter and longer than the chunks, the head dims of the families served; and a bf16
runner picks it by default and computes, for a group, chunked prompts and a next turn, the log-probs of
a runner that pads them.

    pytest -m gpu tests/gpu/test_varlen_attention.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from asyncgrpo.server.kv_cache import PagedKVCache
from asyncgrpo.server.prefix_cache import BlockPool
from asyncgrpo.server.runner import ModelRunner
from asyncgrpo.server.scheduler import Scheduler
from asyncgrpo.server.sequence import SeqParams, Sequence
from asyncgrpo.server.varlen_attention import HALF, VarlenChunks, varlen, varlen_reference, varlen_works_on

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))  # the tiny models of the CPU tests
from test_prefix_caching import VOCAB, _prompt, tiny_qwen3

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


def _serve(model: torch.nn.Module, varlen_prompts: bool | None, work: list[list[int]]) -> tuple[ModelRunner, list]:
    """The prompts of `work` through a bf16 engine (24 tokens per step: long prompts in chunks, the prefix
    cache on); each sequence's top-5 log-probs of its first sampled token."""
    cuda = torch.device("cuda")
    cache = PagedKVCache(2, 64, 16, 2, 16, torch.bfloat16, cuda)
    sched = Scheduler(BlockPool(64, True), 16, 8, 24, 256)
    runner = ModelRunner(model, cache, cuda, VOCAB, sched.block_table, varlen_prompts=varlen_prompts)
    params = SeqParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=0, max_tokens=3, min_tokens=0,
                       stop_token_ids=frozenset(), eos_token_id=None, extra_eos_ids=frozenset(), logprobs=5,
                       want_mask=False)
    seqs = [Sequence(i, f"r{i}", 0, p, params, 256) for i, p in enumerate(work)]
    for s in seqs:
        sched.add(s)
    while any(not s.finished for s in seqs):
        plan = sched.schedule()
        runner.step(plan.decode, plan.prefill).record(plan.sampled, "v")
        for s in plan.sampled:
            if s.finished:
                sched.remove(s)
    return runner, [sorted(s.top(0)[1]) for s in seqs]


def test_a_bf16_runner_packs_prompts_and_computes_what_a_padding_one_computes():
    model = tiny_qwen3().to("cuda", torch.bfloat16)
    prompt = _prompt(0, 45)
    # a group (the later members after cached blocks), a longer prompt extending it (a next turn)
    work = [prompt] * 4 + [prompt + _prompt(1, 30)]
    packed, want = _serve(model, None, work)
    padded, got = _serve(model, False, work)
    assert packed.varlen_prompts and not padded.varlen_prompts
    # bf16: the two attention kernels round differently
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), atol=0.1, rtol=0)
