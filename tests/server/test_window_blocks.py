"""KV blocks of sliding-window models (CPU, float32): a model whose every layer has a window frees the
blocks that fall behind it, so a sequence decoding far past its window holds a couple of blocks, more
sequences fit in a small pool, and log-probs still equal the model's own forward (eager attention);
prefix caching still finds a conversation's history after its first blocks were evicted, and
preemption with a shared prompt gives what an uncached server with room to spare gives. Models that
mix in global layers hold every block."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from transformers import (
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from asyncgrpo.server.attention.plan import resolve_plan
from asyncgrpo.server.attention_math import kv_window
from asyncgrpo.server.kv_cache import PagedKVCache, register_attention
from asyncgrpo.server.prefix_cache import BlockPool, extend_block_hashes
from asyncgrpo.server.runner import ModelRunner
from asyncgrpo.server.scheduler import Scheduler
from asyncgrpo.server.sequence import SeqParams, Sequence

pytestmark = pytest.mark.engine

VOCAB, BS, MAX_LEN = 97, 16, 256
COMMON = {"vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
          "max_position_embeddings": MAX_LEN}


def _mistral(window: int) -> MistralForCausalLM:
    torch.manual_seed(0)
    return MistralForCausalLM(MistralConfig(**COMMON, sliding_window=window)).eval()


@pytest.fixture(scope="module")
def models():
    """(served, reference) pairs of a tiny random Mistral per window."""
    out = {}
    for window in (8, 40):
        reference = _mistral(window)
        reference.set_attn_implementation("eager")
        served = copy.deepcopy(reference)
        served.set_attn_implementation(register_attention())
        out[window] = (served, reference)
    return out


class Harness:
    """An engine without its thread that also records the blocks every running sequence holds."""

    def __init__(self, model, caching: bool, num_blocks: int, budget: int = 4096,
                 free_window: bool = True) -> None:
        cache = PagedKVCache(2, num_blocks, BS, 2, 16, torch.float32, torch.device("cpu"))
        window = kv_window(model, range(2)) if free_window else None
        self.sched = Scheduler(BlockPool(num_blocks, caching), BS, 8, budget, MAX_LEN, window=window)
        plan = resolve_plan(model, cache, torch.device("cpu"))
        self.runner = ModelRunner(model, cache, plan, VOCAB, self.sched.block_table)
        self.num_ids = 0
        self.num_preempted = 0
        self.max_held = 0  # most blocks one sequence held in a step
        self.max_running = 0

    def run(self, prompts_and_seeds: list[tuple[list[int], int]], max_tokens: int) -> list[Sequence]:
        seqs = []
        for prompt, seed in prompts_and_seeds:
            params = SeqParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0,
                               seed=seed, max_tokens=max_tokens,
                               min_tokens=0, stop_token_ids=frozenset(), eos_token_id=None,
                               extra_eos_ids=frozenset(), logprobs=None, want_mask=False)
            seqs.append(Sequence(self.num_ids, f"r{self.num_ids}", 0, list(prompt), params, MAX_LEN))
            self.num_ids += 1
            self.sched.add(seqs[-1])
        while any(not s.finished for s in seqs):
            plan = self.sched.schedule()
            self.num_preempted += len(plan.preempted)
            self.max_running = max(self.max_running, len(self.sched.running))
            # a chunk the pool could not grow is left for a later step, not planned empty
            for s in plan.prefill:
                assert s.prefill_end > s.prefill_start, (s.prefill_start, s.prefill_end)
            for s in self.sched.running:
                held = [b for b in s.blocks if b != self.sched.null_block]
                assert len(held) == len(s.blocks) - s.released
                self.max_held = max(self.max_held, len(held))
            self.runner.step(plan.decode, plan.prefill).record(plan.sampled, "v")
            for s in plan.sampled:
                if s.finished:
                    self.sched.remove(s)
        assert self.sched.pool.num_free == self.sched.pool.num_blocks  # every block came back
        return seqs


def _prompt(seed: int, n: int) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _assert_model_logprobs(reference, seqs: list[Sequence]) -> None:
    for seq in seqs:
        with torch.no_grad():
            logits = reference(torch.tensor([seq.all_tokens()])).logits[0, len(seq.prompt) - 1 : -1].float()
        expected = torch.log_softmax(logits, -1).gather(1, torch.tensor(seq.output)[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(seq.logprobs), expected, atol=2e-4, rtol=0)


def test_the_window_that_bounds_the_kv_cache_is_every_layers_or_none():
    small = {**COMMON, "hidden_size": 32, "intermediate_size": 32, "num_attention_heads": 2, "head_dim": 16}
    assert kv_window(MistralForCausalLM(MistralConfig(**small, sliding_window=8)), range(2)) == 8
    assert kv_window(MistralForCausalLM(MistralConfig(**small, sliding_window=None)), range(2)) is None
    qwen2 = Qwen2Config(**small, use_sliding_window=True, sliding_window=12, max_window_layers=0)
    assert kv_window(Qwen2ForCausalLM(qwen2), range(2)) == 12  # every layer windowed
    qwen2 = Qwen2Config(**small, use_sliding_window=True, sliding_window=12, max_window_layers=1)
    assert kv_window(Qwen2ForCausalLM(qwen2), range(2)) is None  # layer 0 is global
    gemma3 = Gemma3TextConfig(**small, sliding_window=8, layer_types=["sliding_attention", "full_attention"])
    assert kv_window(Gemma3ForCausalLM(gemma3), range(2)) is None
    assert kv_window(Qwen3ForCausalLM(Qwen3Config(**small)), range(2)) is None
    # attention modules that do not match the served attention layers: hold everything
    assert kv_window(MistralForCausalLM(MistralConfig(**small, sliding_window=8)), range(3)) is None


@pytest.mark.parametrize("budget,prompt_len", [(4096, 20), (7, 60)])
def test_a_window_8_model_decoding_far_past_its_window_holds_two_blocks_and_matches_its_forward(
    models, budget, prompt_len
):
    served, reference = models[8]
    harness = Harness(served, caching=True, num_blocks=64, budget=budget)
    prompt = _prompt(1, prompt_len)
    seqs = harness.run([(prompt, seed) for seed in range(3)], max_tokens=64)  # 8x the window
    assert all(len(s.output) == 64 for s in seqs)
    assert harness.max_held <= math.ceil(8 / BS) + 1  # the window's tokens straddle at most two blocks
    assert harness.sched.pool.stats.hits > 0  # the later samples found the prompt's last blocks
    _assert_model_logprobs(reference, seqs)


def test_freed_blocks_let_more_sequences_run_in_a_small_pool(models):
    served, reference = models[8]
    work = [(_prompt(10 + i, 20), i) for i in range(4)]  # 4 x 80 tokens in a pool of 128 tokens
    freeing = Harness(served, caching=False, num_blocks=8)
    holding = Harness(served, caching=False, num_blocks=8, free_window=False)
    a, b = freeing.run(work, max_tokens=60), holding.run(work, max_tokens=60)
    assert freeing.num_preempted == 0 and freeing.max_running == 4
    assert holding.num_preempted > 0
    assert [s.output for s in a] == [s.output for s in b]
    _assert_model_logprobs(reference, a)


def test_a_later_turn_finds_its_history_after_the_first_blocks_were_evicted(models):
    served, reference = models[8]
    harness = Harness(served, caching=True, num_blocks=12)
    first = harness.run([(_prompt(2, 20), 0)], max_tokens=100)[0]
    hashes = extend_block_hashes([], first.all_tokens(), BS, first.num_tokens // BS)
    assert len(harness.sched.pool.match(hashes)) == len(hashes)  # every full block is cached
    # unrelated work takes the free blocks and then the least recently released cached ones: the
    # first turn's early blocks, released as its window moved on
    harness.run([(_prompt(3, 20), 1)], max_tokens=100)
    assert harness.sched.pool.match(hashes) == []
    hits = harness.sched.pool.stats.hits
    turn = first.all_tokens() + _prompt(4, 5)
    second = harness.run([(turn, 2)], max_tokens=20)[0]
    assert harness.sched.pool.stats.hits - hits == len(hashes) * BS  # all the history but its partial block
    _assert_model_logprobs(reference, [second])


@pytest.mark.slow
def test_preemption_with_a_shared_prompt_matches_an_uncached_server_with_room_to_spare(models):
    served, reference = models[40]  # a window of 40 tokens: up to 4 blocks held per sequence
    prompt = _prompt(5, 40)
    work = [(prompt, seed) for seed in range(4)] + [(_prompt(6, 30), 9)]
    small = Harness(served, caching=True, num_blocks=9, budget=24)
    roomy = Harness(served, caching=False, num_blocks=64)
    a, b = small.run(work, max_tokens=60), roomy.run(work, max_tokens=60)
    assert small.num_preempted > 0 and small.sched.pool.stats.hits > 0
    assert small.max_held <= math.ceil(39 / BS) + 1 + math.ceil(24 / BS)  # window + one chunk
    assert [s.output for s in a] == [s.output for s in b]
    for x, y in zip(a, b):
        torch.testing.assert_close(torch.tensor(x.logprobs), torch.tensor(y.logprobs), atol=1e-4, rtol=0)
    _assert_model_logprobs(reference, a)
