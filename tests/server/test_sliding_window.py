"""Sliding-window families served by the embedded server's engine (scheduler + runner, paged attention,
float32 on CPU): the log-prob of every sampled token equals the log-softmax of the model's own forward
(eager attention) on prompt + output, for prompts longer than the window, prefilled whole, in chunks
and after a cached prefix, with decode steps past the window (Mistral's blocks behind its window freed);
with prompt chunks padded, and packed as for FlashAttention's variable-length kernel (its left window;
here its reference computation), which soft-capped layers (Gemma 2) refuse."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import (
    Cohere2Config,
    Cohere2ForCausalLM,
    Gemma2Config,
    Gemma2ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    MistralConfig,
    MistralForCausalLM,
)

from asyncgrpo.server.attention.base import PlanFlags
from asyncgrpo.server.attention.plan import resolve_plan
from asyncgrpo.server.attention_math import kv_window
from asyncgrpo.server.kv_cache import PagedKVCache, register_attention
from asyncgrpo.server.prefix_cache import BlockPool
from asyncgrpo.server.runner import ModelRunner
from asyncgrpo.server.scheduler import Scheduler
from asyncgrpo.server.sequence import SeqParams, Sequence

pytestmark = pytest.mark.engine

VOCAB, WINDOW, BS = 97, 8, 4
COMMON = {"vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 256,
          "sliding_window": WINDOW}
LAYERS = ["sliding_attention", "full_attention"]
FAMILIES = {
    "mistral": lambda: MistralForCausalLM(MistralConfig(**COMMON)),
    "gemma2": lambda: Gemma2ForCausalLM(Gemma2Config(**COMMON, layer_types=LAYERS, attn_logit_softcapping=5.0,
                                                     final_logit_softcapping=3.0)),
    "gemma3": lambda: Gemma3ForCausalLM(Gemma3TextConfig(**COMMON, layer_types=LAYERS)),
    "cohere2": lambda: Cohere2ForCausalLM(Cohere2Config(**COMMON, layer_types=LAYERS)),
}


# soft-capped layers (Gemma 2) keep the padded layouts (a test below checks the refusal)
@pytest.mark.parametrize("family,varlen", [pytest.param(f, v, id=f"{f}-{'packed' if v else 'padded'}")
                                           for f in sorted(FAMILIES) for v in (False, True)
                                           if not (v and f == "gemma2")])
def test_logprobs_equal_the_models_own_forward(family, varlen):
    torch.manual_seed(0)
    reference = FAMILIES[family]().eval()
    reference.set_attn_implementation("eager")
    served = copy.deepcopy(reference)
    served.set_attn_implementation(register_attention())
    cache = PagedKVCache(2, 64, BS, 2, 16, torch.float32, torch.device("cpu"))
    # 7 tokens per step: prompts prefilled in chunks; Mistral (windowed everywhere) frees blocks behind it
    sched = Scheduler(BlockPool(64), BS, 4, 7, 256, window=kv_window(served, range(2)))
    # varlen: prompt chunks packed as for FlashAttention's variable-length kernel (its left window)
    plan = resolve_plan(served, cache, torch.device("cpu"), PlanFlags(packed_prompts=varlen))
    runner = ModelRunner(served, cache, plan, VOCAB, sched.block_table)
    params = SeqParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=0, max_tokens=14, min_tokens=0,
                       stop_token_ids=frozenset(), eos_token_id=None,
                       extra_eos_ids=frozenset(), logprobs=None, want_mask=False)
    prompt = torch.randint(0, VOCAB, (21,), generator=torch.Generator().manual_seed(1)).tolist()
    seqs = [Sequence(i, f"r{i}", 0, prompt, SeqParams(**{**params.__dict__, "seed": i}), 256)
            for i in range(3)]
    for i, seq in enumerate(seqs):
        sched.add(seq)
        if i == 0:  # the later two find the first one's prompt blocks in the prefix cache
            while not seq.finished:
                plan = sched.schedule()
                runner.step(plan.decode, plan.prefill).record(plan.sampled, "v")
            sched.remove(seq)
    while any(not s.finished for s in seqs):
        plan = sched.schedule()
        runner.step(plan.decode, plan.prefill).record(plan.sampled, "v")
        for s in plan.sampled:
            if s.finished:
                sched.remove(s)
    assert sched.pool.stats.hits > 0
    for seq in seqs:
        with torch.no_grad():
            logits = reference(torch.tensor([seq.all_tokens()])).logits[0, len(prompt) - 1 : -1].float()
        expected = torch.log_softmax(logits, -1).gather(1, torch.tensor(seq.output)[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(seq.logprobs), expected, atol=2e-4, rtol=0)


def test_packed_prompt_chunks_are_refused_for_soft_capped_layers():
    served = FAMILIES["gemma2"]().eval()
    served.set_attn_implementation(register_attention())
    cache = PagedKVCache(2, 8, BS, 2, 16, torch.float32, torch.device("cpu"))
    with pytest.raises(ValueError, match="soft-cap"):
        resolve_plan(served, cache, torch.device("cpu"), PlanFlags(packed_prompts=True))
