"""On the GPU, the engine reading groups' shared prompt blocks once (the Triton shared pass, inside the
captured decode graphs) samples what it samples when every sequence reads its own copy.

    pytest -m gpu tests/gpu/test_shared_prefix_attention.py
"""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from asyncgrpo.server.attention.base import PlanFlags
from asyncgrpo.server.attention.plan import resolve_plan
from asyncgrpo.server.decode_kernels import triton_available
from asyncgrpo.server.kv_cache import PagedKVCache, register_attention
from asyncgrpo.server.prefix_cache import BlockPool
from asyncgrpo.server.runner import ModelRunner
from asyncgrpo.server.scheduler import Scheduler
from asyncgrpo.server.sequence import SeqParams, Sequence
from asyncgrpo.server.step_graphs import StepGraphs

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or not triton_available(),
                       reason="needs CUDA and Triton"),
]

BS, MAX_LEN, VOCAB = 16, 512, 257


def _run(model, shared_prefix: bool, work, max_tokens: int) -> list[Sequence]:
    cuda = torch.device("cuda")
    cache = PagedKVCache(2, 400, BS, 2, 64, torch.float32, cuda)
    sched = Scheduler(BlockPool(400), BS, 32, 8192, MAX_LEN)
    plan = resolve_plan(model, cache, cuda, PlanFlags(shared_prefix=shared_prefix))
    graphs = StepGraphs(model, cache, plan, 32, sched.max_blocks, True, VOCAB)
    runner = ModelRunner(model, cache, plan, VOCAB, sched.block_table, graphs)
    assert (runner.plan.shared_members > 0) == shared_prefix
    seqs = []
    for i, (prompt, seed) in enumerate(work):
        params = SeqParams(temperature=1.0, top_k=20, top_p=1.0, min_p=0.0, seed=seed, max_tokens=max_tokens,
                           min_tokens=0, stop_token_ids=frozenset(), eos_token_id=None,
                           extra_eos_ids=frozenset(), logprobs=4, want_mask=False)
        seqs.append(Sequence(i, f"r{i}", 0, prompt, params, MAX_LEN))
    pending = list(seqs)
    steps = 0
    while pending or sched.has_work():
        if pending and steps % 5 == 0:  # a group joins every fifth step: graphs with 1, 2, 4... entries
            for _ in range(4):
                if pending:
                    sched.add(pending.pop(0))
        plan = sched.schedule()
        runner.step(plan.decode, plan.prefill).record(plan.sampled, "v")
        for s in plan.sampled:
            if s.finished:
                sched.remove(s)
        steps += 1
    return seqs


def test_groups_sample_the_same_with_and_without_the_shared_pass():
    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                         max_position_embeddings=1024)
    model = Qwen3ForCausalLM(copy.deepcopy(config)).eval().cuda()
    model.set_attn_implementation(register_attention())
    g = torch.Generator().manual_seed(1)
    system = torch.randint(1, VOCAB, (20,), generator=g).tolist()
    work = []
    for group in range(6):  # groups of 4 behind a common system prompt, prompts of 5-12 blocks
        prompt = system + torch.randint(1, VOCAB, (60 + 20 * group,), generator=g).tolist()
        work += [(prompt, 10 * group + i) for i in range(4)]
    with torch.inference_mode():
        shared = _run(model, True, work, max_tokens=40)
        plain = _run(model, False, work, max_tokens=40)
    for a, b in zip(shared, plain, strict=True):
        assert a.output == b.output
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-4, rtol=0)
