"""On the GPU, steps replayed as CUDA graphs sample what the eager runner samples, for the two kinds of
served model whose graphs carry more than the KV cache: a Gated DeltaNet hybrid (each row's recurrent
state slot in a static buffer; the capture's warm-up on a scratch slot) and LoRA adapters (each row's
slot a one-hot in a static buffer). The graphs must be captured, not fallen back to eager steps.

    pytest -m gpu tests/gpu/test_graph_steps.py
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from asyncgrpo.server.attention.plan import resolve_plan
from asyncgrpo.server.decode_kernels import triton_available
from asyncgrpo.server.kv_cache import PagedKVCache, register_attention
from asyncgrpo.server.loading import prepare_model
from asyncgrpo.server.prefix_cache import BlockPool
from asyncgrpo.server.recurrent_state import RecurrentState
from asyncgrpo.server.runner import ModelRunner
from asyncgrpo.server.scheduler import Scheduler
from asyncgrpo.server.sequence import Sequence
from asyncgrpo.server.step_graphs import StepGraphs

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "packing"))  # the tiny models of the CPU tests
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "server"))
from test_recurrent_state import params, run, sensitive_hybrid
from test_tree_deltanet import HYBRIDS

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or not triton_available(),
                       reason="needs CUDA and Triton"),
]

MAX_LEN = 256


def _assert_same(a: list[Sequence], b: list[Sequence]) -> None:
    for x, y in zip(a, b, strict=True):
        assert x.output == y.output
        torch.testing.assert_close(torch.tensor(x.logprobs), torch.tensor(y.logprobs), atol=1e-4, rtol=0)


@pytest.mark.parametrize("model_type", ["qwen3_5_text", "qwen3_next"])
def test_hybrid_decode_graph_steps_sample_what_eager_steps_sample(model_type):
    cuda = torch.device("cuda")
    model = sensitive_hybrid(model_type).to(cuda)
    prepare_model(model, cuda)
    text = model.config.get_text_config()
    lengths = [(9, 40), (1, 12), (70, 6), (2, 30), (33, 5)]

    def serve(fixed: bool) -> tuple[list[Sequence], StepGraphs | None]:
        cache = PagedKVCache(text.num_hidden_layers, 64, 16, text.num_key_value_heads, text.head_dim,
                             torch.float32, cuda)
        sched = Scheduler(BlockPool(64, enable_caching=False), 16, 8, 4096, MAX_LEN)
        recurrent = RecurrentState.for_model(model, 8, cuda)
        plan = resolve_plan(model, cache, cuda)
        graphs = StepGraphs(model, cache, plan, 8, sched.max_blocks, True, text.vocab_size,
                            recurrent=recurrent) if fixed else None
        runner = ModelRunner(model, cache, plan, text.vocab_size, sched.block_table,
                             graphs, recurrent=recurrent)
        seqs = [Sequence(i, f"r{i}", 0, [(7 * i + 3 * j) % 96 for j in range(p)], params(i, n), MAX_LEN)
                for i, (p, n) in enumerate(lengths)]
        run(sched, runner, seqs, join_every=3)
        return seqs, graphs

    with torch.inference_mode():
        fixed, graphs = serve(True)
        eager, _ = serve(False)
    if not HYBRIDS[model_type]:  # dense: captured, no fallback (a MoE router as transformers runs its experts
        # eagerly may synchronise with the host, and the graphs then fall back to eager steps, logged)
        assert graphs.use_graphs and any(key[0] == "forward" for key in graphs._graphs)
    _assert_same(fixed, eager)


def test_lora_graphs_sample_what_eager_steps_sample(tmp_path):
    peft = pytest.importorskip("peft")
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from asyncgrpo.server.lora import ServedLora
    from asyncgrpo.server.lora_files import read_adapter

    cuda = torch.device("cuda")
    config = Qwen3Config(vocab_size=257, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                         max_position_embeddings=1024)
    for name, seed in (("a", 1), ("b", 2)):
        torch.manual_seed(seed)
        adapter = peft.get_peft_model(Qwen3ForCausalLM(copy.deepcopy(config)),
                                      peft.LoraConfig(init_lora_weights=False, r=8, lora_alpha=16,
                                                      target_modules="all-linear"))
        adapter.save_pretrained(tmp_path / name)
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(copy.deepcopy(config)).eval().to(cuda)
    model.set_attn_implementation(register_attention())
    prepare_model(model, cuda)
    lora = ServedLora(model, max_loras=2, max_rank=8)
    for slot, name in enumerate("ab"):
        lora.write(slot, read_adapter(name, str(tmp_path / name), lora.targets(), 8))
    prompt = torch.randint(1, 257, (45,), generator=torch.Generator().manual_seed(3)).tolist()

    def serve(fixed: bool) -> tuple[list[Sequence], StepGraphs | None]:
        cache = PagedKVCache(2, 200, 16, 2, 64, torch.float32, cuda)
        sched = Scheduler(BlockPool(200), 16, 8, 4096, MAX_LEN)
        plan = resolve_plan(model, cache, cuda)
        graphs = StepGraphs(model, cache, plan, 8, sched.max_blocks, True, 257, lora=lora) if fixed else None
        runner = ModelRunner(model, cache, plan, 257, sched.block_table, graphs, lora=lora)
        seqs = [Sequence(i, f"r{i}", 0, prompt + [i // 3], params(i % 3, 20), MAX_LEN, lora_slot=slot,
                         hash_root=bytes([slot + 1])) for i, slot in enumerate([0, 1, -1, 0, 1, -1])]
        run(sched, runner, seqs, join_every=2)
        return seqs, graphs

    with torch.inference_mode():
        fixed, graphs = serve(True)
        eager, _ = serve(False)
    assert graphs.use_graphs and any(key[0] == "forward" and key[-1] for key in graphs._graphs)
    _assert_same(fixed, eager)
    assert len({tuple(np.round(s.logprobs, 3)) for s in fixed[:3]}) == 3  # the adapters change the sampling
