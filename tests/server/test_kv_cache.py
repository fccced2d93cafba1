"""Paged attention of the embedded server against the model's own full-sequence forward pass."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from asyncgrpo.server.attention.plan import resolve_plan
from asyncgrpo.server.decode_kernels import choose_splits, one_split_programs
from asyncgrpo.server.fused_layers import fuse_layers
from asyncgrpo.server.kv_cache import PagedKVCache, register_attention
from asyncgrpo.server.prefix_cache import BlockPool
from asyncgrpo.server.step_graphs import StepGraphs, batch_bucket, block_bucket
from asyncgrpo.server.step_rows import decode_inputs

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module", params=["own forwards", "fused layers"])
def models(request):
    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         max_position_embeddings=128)
    reference = Qwen3ForCausalLM(config).eval()
    paged = Qwen3ForCausalLM(copy.deepcopy(config)).eval()  # set_attn_implementation edits the config
    paged.load_state_dict(reference.state_dict())
    paged.set_attn_implementation(register_attention())
    if request.param == "fused layers":
        assert fuse_layers(paged, triton=False).attention == 2
    return reference, paged


def _step(model, cache, seqs, decode, prefill):
    """One flat forward: `decode` names sequences with one new token, `prefill` whole prompts."""
    bs = cache.block_size
    ids, pos, slots, last = [], [], [], []
    for name in decode:
        toks, blocks = seqs[name]
        p = len(toks) - 1
        ids.append(toks[-1]), pos.append(p), slots.append(blocks[p // bs] * bs + p % bs)
        last.append(len(ids) - 1)
    for name in prefill:
        toks, blocks = seqs[name]
        ids += toks
        pos += range(len(toks))
        slots += [blocks[p // bs] * bs + p % bs for p in range(len(toks))]
        last.append(len(ids) - 1)
    nb = max((len(seqs[n][1]) for n in decode), default=0)
    tables = torch.tensor([seqs[n][1] + [0] * (nb - len(seqs[n][1])) for n in decode], dtype=torch.int64)
    meta = resolve_plan(model, cache, torch.device("cpu")).attention(
        cache, slots, tables, [len(seqs[n][0]) for n in decode], [len(seqs[n][0]) for n in prefill])
    with torch.no_grad():
        out = model(input_ids=torch.tensor([ids]), position_ids=torch.tensor([pos]), use_cache=False,
                    logits_to_keep=torch.tensor(last), kv_meta=meta)
    return out.logits[0]


def test_mixed_prefill_and_decode_steps_match_full_forward(models):
    reference, paged = models
    cache = PagedKVCache(2, num_blocks=12, block_size=4, num_kv_heads=2, head_dim=16, dtype=torch.float32,
                         device=torch.device("cpu"))
    alloc = BlockPool(12)
    g = torch.Generator().manual_seed(1)
    seqs = {}

    def new(name, n):
        toks = torch.randint(0, 97, (n,), generator=g).tolist()
        seqs[name] = (toks, alloc.allocate(-(-n // 4)))

    def grow(name):
        toks, blocks = seqs[name]
        toks.append(int(torch.randint(0, 97, (1,), generator=g)))
        if len(blocks) * 4 < len(toks):
            blocks.extend(alloc.allocate(1))

    def expected(names):
        with torch.no_grad():
            return torch.stack([reference(torch.tensor([seqs[n][0]])).logits[0, -1] for n in names])

    new("a", 7), new("b", 3)
    got = _step(paged, cache, seqs, [], ["a", "b"])  # two prompts: padded prefill path
    torch.testing.assert_close(got, expected(["a", "b"]), atol=1e-5, rtol=1e-5)
    for _ in range(3):
        grow("a"), grow("b")
        got = _step(paged, cache, seqs, ["a", "b"], [])
        torch.testing.assert_close(got, expected(["a", "b"]), atol=1e-5, rtol=1e-5)
    grow("a"), grow("b"), new("c", 5)
    got = _step(paged, cache, seqs, ["a", "b"], ["c"])  # decode and a single prefill in one pass
    torch.testing.assert_close(got, expected(["a", "b", "c"]), atol=1e-5, rtol=1e-5)
    # fixed-shape decode path (what CUDA graphs replay): 3 rows padded to 4, tables to 4 blocks
    graphs = StepGraphs(paged, cache, resolve_plan(paged, cache, torch.device("cpu")),
                        max_num_seqs=8, max_blocks=8, use_graphs=False, vocab_size=97)
    for _ in range(2):
        for n in "abc":
            grow(n)
        names = ["a", "b", "c"]
        table = np.zeros((8, 8), dtype=np.int64)
        for i, n in enumerate(names):
            table[i, : len(seqs[n][1])] = seqs[n][1]
        inputs = decode_inputs(np.array([seqs[n][0][-1] for n in names]),
                               np.array([len(seqs[n][0]) for n in names]), np.arange(3), table, 4)
        got = graphs.run(inputs)
        torch.testing.assert_close(got, expected(names), atol=1e-5, rtol=1e-5)
    grow("a"), grow("c")
    got = _step(paged, cache, seqs, ["a", "c"], [])  # the padded row wrote only the scratch block
    torch.testing.assert_close(got, expected(["a", "c"]), atol=1e-5, rtol=1e-5)
    assert alloc.num_free == 12 - sum(len(b) for _, b in seqs.values())


def test_buckets():
    assert [batch_bucket(n) for n in (1, 3, 5, 17, 33, 64, 65, 256)] == [1, 4, 8, 32, 64, 64, 96, 256]
    assert [batch_bucket(n) for n in (257, 384, 385, 1280)] == [384, 384, 512, 1280]  # steps with prompt rows
    assert [block_bucket(n, 40) for n in (1, 3, 9, 33)] == [1, 4, 16, 40]


def test_small_decode_batches_split_the_context_across_programs():
    """(splits, tokens per split): about two programs per multiprocessor, whole tiles per split."""
    assert choose_splits(num_programs=8, max_context=512, tile=64, num_sms=132) == (8, 64)
    assert choose_splits(num_programs=128, max_context=512, tile=64, num_sms=132) == (3, 192)
    assert choose_splits(num_programs=2048, max_context=512, tile=64, num_sms=132) == (1, 512)
    assert choose_splits(num_programs=8, max_context=16, tile=64, num_sms=132) == (1, 64)
    # from one_split_programs on, no context is split, however long: a graph of such a step can take the
    # whole block table (ExecutionPlan.unsplit_rows); one program fewer and long contexts are split
    for context in (16, 512, 32768):
        assert choose_splits(one_split_programs(132), context, 64, 132)[0] == 1
    assert choose_splits(one_split_programs(132) - 1, 32768, 64, 132)[0] == 2


class _Captured:
    """What a captured graph is to `StepGraphs._replay` (capture needs CUDA: tests stand in for it)."""

    def replay(self) -> None:
        pass


def _graphs_capturing_on_cpu(paged) -> StepGraphs:
    """CPU step graphs that take the capture path (`_capture` is the test's to replace)."""
    cache = PagedKVCache(2, 8, 4, 2, 16, torch.float32, torch.device("cpu"))
    graphs = StepGraphs(paged, cache, resolve_plan(paged, cache, torch.device("cpu")), 8, 8, use_graphs=False,
                        vocab_size=97)
    graphs.use_graphs = True
    return graphs


def test_past_max_graphs_steps_of_new_shapes_run_the_static_path_eagerly(models, monkeypatch):
    """Graphs are kept per (rows, blocks, groups) bucket; once MAX_GRAPHS are kept, a step of a shape not
    met yet runs its static path eagerly instead of capturing one more. Capture needs CUDA, so a
    stand-in records what would be captured; keys met before still replay."""
    from asyncgrpo.server import step_graphs

    graphs = _graphs_capturing_on_cpu(models[1])
    captured = []

    def capture(key, fn):
        captured.append(key)
        graphs._graphs[key] = (_Captured(), fn())

    monkeypatch.setattr(graphs, "_capture", capture)
    monkeypatch.setattr(step_graphs, "MAX_GRAPHS", 2)
    ran = []

    def step(value):
        return lambda: ran.append(value) or torch.tensor(value)

    assert graphs._replay(("forward", 1), step(1)) == 1 and graphs._replay(("forward", 2), step(2)) == 2
    assert graphs._replay(("forward", 1), step(9)) == 1  # replayed: the captured output, nothing run
    assert graphs._replay(("forward", 3), step(3)) == 3 and graphs._replay(("forward", 3), step(4)) == 4
    assert captured == [("forward", 1), ("forward", 2)] and ran == [1, 2, 3, 4]


@pytest.mark.parametrize("failures, captures, eager", [
    ([torch.cuda.OutOfMemoryError("no room")], 2, False),  # retried once after the cache is handed back
    ([torch.cuda.OutOfMemoryError("no room")] * 2, 2, True),
    ([RuntimeError("operation not permitted when stream is capturing")], 1, True),  # not retried
    ([ValueError("anything else")], 1, True),
])
def test_a_failed_capture_is_retried_only_when_it_ran_out_of_memory(models, monkeypatch,
                                                                    caplog, failures, captures, eager):
    """Out of memory: one more attempt; any other failure (a capture CUDA cut off can leave the allocator
    mid-capture, where emptying its cache fails too): none. Either way the step runs and, when no graph
    came of it, every later step runs eagerly, said once in the log."""
    graphs = _graphs_capturing_on_cpu(models[1])
    attempts = []

    def capture(key, fn):
        attempts.append(key)
        if len(attempts) <= len(failures):
            raise failures[len(attempts) - 1]
        graphs._graphs[key] = (_Captured(), fn())

    monkeypatch.setattr(graphs, "_capture", capture)
    assert graphs._replay(("forward", 1), lambda: torch.tensor(7)) == 7
    assert len(attempts) == captures and graphs.use_graphs is not eager
    assert ("steps run eagerly from now on" in caplog.text) is eager
