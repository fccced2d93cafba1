"""server/lora.py and server/lora_files.py: adapter files, the batched delta, slot ownership.

The delta test runs one forward pass of a tiny random Qwen3 (its attention and MLP fused as the server
fuses them) whose batch rows use adapter 1, adapter 2 and no adapter, and compares each row with the
PEFT model of that adapter merged into the weights.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from asyncgrpo.server.fused_layers import fuse_layers
from asyncgrpo.server.lora import AdapterRegistry, ServedLora
from asyncgrpo.server.lora_files import AdapterLoadError, AdapterNotFound, read_adapter

pytestmark = pytest.mark.engine

peft = pytest.importorskip("peft")


def _tiny(seed: int = 0):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    config = Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64)
    return Qwen3ForCausalLM(config).eval()


def _adapter(path, seed: int, **kwargs) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = peft.get_peft_model(_tiny(), peft.LoraConfig(init_lora_weights=False, **kwargs))
    model.save_pretrained(path)
    return model.merge_and_unload().eval()


# every slot in use; only some (their rows gathered)
@pytest.mark.parametrize("slot_a, slot_b", [(2, 0), (2, 1)])
def test_one_forward_serves_two_adapters_and_the_base_model_each_as_its_merged_reference(
        tmp_path, slot_a, slot_b):
    refs = [
        _adapter(tmp_path / "a", 1, r=4, lora_alpha=8, target_modules="all-linear"),
        _adapter(tmp_path / "b", 2, r=2, lora_alpha=16, use_rslora=True, target_modules=["k_proj", "up_proj"],
                 rank_pattern={"up_proj": 8}, alpha_pattern={"k_proj": 3}),
        _tiny(),
    ]
    model = _tiny()
    assert fuse_layers(model, triton=False).attention == 2  # the joined q/k/v and gate/up hooks are exercised
    lora = ServedLora(model, max_loras=3, max_rank=8)
    for slot, name in ((slot_a, "a"), (slot_b, "b")):  # slots need not follow load order
        lora.write(slot, read_adapter(name, str(tmp_path / name), lora.targets(), 8))
    ids = torch.randint(0, 64, (3, 10), generator=torch.Generator().manual_seed(0))
    slots = np.repeat(np.array([slot_a, slot_b, -1]), 10)
    with torch.no_grad(), lora.step(slots):
        logits = model(ids).logits
    with torch.no_grad():
        expected = torch.stack([ref(ids[i : i + 1]).logits[0] for i, ref in enumerate(refs)])
        base = refs[2](ids).logits
    assert (logits - expected).abs().max() < 1e-5
    assert (base[:2] - expected[:2]).abs().amax(dim=(1, 2)).min() > 1e-2  # both adapters change the output
    with torch.no_grad():  # outside a step (the self-check, a hybrid layer's own forward): the base model
        assert (model(ids).logits - base).abs().max() < 1e-5


def test_adapter_files_are_checked_like_vllm(tmp_path):
    lora = ServedLora(_tiny(), max_loras=1, max_rank=8)
    _adapter(tmp_path / "a", 1, r=4, lora_alpha=8, target_modules=["q_proj"])
    with pytest.raises(AdapterNotFound, match=r"Loading lora x failed: No adapter found for /nowhere"):
        read_adapter("x", "/nowhere", lora.targets(), 8)
    with pytest.raises(AdapterLoadError,
                       match=r"LoRA rank 4 is greater than max_lora_rank 1; restart the server "
                                                r"with --max-lora-rank 8"):
        read_adapter("a", str(tmp_path / "a"), lora.targets(), 1)
    config = json.loads((tmp_path / "a" / "adapter_config.json").read_text())
    for change, message in (({"use_dora": True}, "DoRA"), ({"bias": "all"}, "Adapter bias is not supported"),
                            ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
                            ({"init_lora_weights": "pissa"}, "init_lora_weights='pissa'"),
                            ({"layer_replication": [[0, 2]]}, "layer_replication"),
                            ({"use_qalora": True}, "QALoRA")):
        (tmp_path / "a" / "adapter_config.json").write_text(json.dumps({**config, **change}))
        with pytest.raises(AdapterLoadError, match=message):
            read_adapter("a", str(tmp_path / "a"), lora.targets(), 8)
    # inits that only set the first adapter weights leave a plain LoRA, which loads
    (tmp_path / "a" / "adapter_config.json").write_text(
        json.dumps({**config, "init_lora_weights": "gaussian"}))
    assert read_adapter("a", str(tmp_path / "a"), lora.targets(), 8).rank == 4
    (tmp_path / "a" / "adapter_config.json").write_text(json.dumps(config))
    (tmp_path / "a" / "adapter_model.safetensors").unlink()
    with pytest.raises(AdapterLoadError, match="doesn't contain tensors"):
        read_adapter("a", str(tmp_path / "a"), lora.targets(), 8)


def test_an_unloaded_adapter_keeps_its_slot_until_its_last_request_ends():
    registry = AdapterRegistry(max_loras=1)
    slot = registry.reserve("v1")
    v1 = registry.add("v1", "/p1", slot, 4)
    with registry.using(v1):
        registry.remove("v1")
        assert "v1" not in registry.by_name and v1.unloaded
        assert registry.reserve("v2") is None  # its weights still serve a running request
    slot = registry.reserve("v2")
    assert slot == v1.slot
    v2 = registry.add("v2", "/p2", slot, 4)
    assert v2.hash_root != v1.hash_root


def test_a_reload_under_the_same_name_gets_a_new_slot_and_cache_root():
    registry = AdapterRegistry(max_loras=2)
    first = registry.add("v", "/p", registry.reserve("v"), 4)
    with registry.using(first):
        second = registry.add("v", "/p", registry.reserve("v"), 4)
        assert registry.by_name["v"] is second and second.slot != first.slot
        assert second.hash_root != first.hash_root
        assert registry.reserve("w") is None  # the first load's slot is still in use
    assert registry.reserve("w") == first.slot


def test_fixed_shape_steps_serve_adapters_as_the_eager_steps_do(tmp_path):
    """The path CUDA graphs replay (decode steps, and steps whose prompt chunks are rows of the decode
    attention), run eagerly on the CPU: requests under two adapters and the base model, in one batch,
    sample what the eager runner samples, and the adapters change what is sampled."""
    from asyncgrpo.server.attention.base import PlanFlags
    from asyncgrpo.server.attention.plan import resolve_plan
    from asyncgrpo.server.kv_cache import PagedKVCache, register_attention
    from asyncgrpo.server.prefix_cache import BlockPool
    from asyncgrpo.server.runner import ModelRunner
    from asyncgrpo.server.scheduler import Scheduler
    from asyncgrpo.server.sequence import SeqParams, Sequence
    from asyncgrpo.server.step_graphs import StepGraphs

    for name, seed in (("a", 1), ("b", 2)):
        _adapter(tmp_path / name, seed, r=4, lora_alpha=8, target_modules="all-linear")
    model = _tiny()
    model.set_attn_implementation(register_attention())
    assert fuse_layers(model, triton=False).attention == 2
    lora = ServedLora(model, max_loras=2, max_rank=8)
    for slot, name in enumerate("ab"):
        lora.write(slot, read_adapter(name, str(tmp_path / name), lora.targets(), 8))
    cpu = torch.device("cpu")
    prompt = torch.randint(0, 64, (37,), generator=torch.Generator().manual_seed(3)).tolist()

    def run(fixed: bool) -> list[Sequence]:
        cache = PagedKVCache(2, 80, 16, 2, 8, torch.float32, cpu)
        sched = Scheduler(BlockPool(80), 16, 8, 4096, 64)
        plan = resolve_plan(model, cache, cpu, PlanFlags(shared_prefix=fixed, continued_rows=fixed))
        graphs = StepGraphs(model, cache, plan, 8, sched.max_blocks, False, 64, lora=lora) if fixed else None
        runner = ModelRunner(model, cache, plan, 64, sched.block_table, graphs, lora=lora)
        seqs = []
        for i, slot in enumerate([0, 1, -1, 0, 1, -1]):
            params = SeqParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=i % 3, max_tokens=12,
                               min_tokens=0, stop_token_ids=frozenset(), eos_token_id=None,
                               extra_eos_ids=frozenset(), logprobs=2, want_mask=False)
            seq = Sequence(i, f"r{i}", 0, prompt + [i // 3], params, 64, lora_slot=slot,
                           hash_root=bytes([slot + 1]))
            seqs.append(seq)
            sched.add(seq)
        while sched.has_work():
            plan = sched.schedule()
            runner.step(plan.decode, plan.prefill).record(plan.sampled, "v")
            for s in plan.sampled:
                if s.finished:
                    sched.remove(s)
        return seqs

    with torch.no_grad():
        fixed, eager = run(True), run(False)
    for a, b in zip(fixed, eager, strict=True):
        assert a.output == b.output
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-4, rtol=0)
    # same prompt and seed under adapter a, adapter b and the base model: three different samplings
    assert len({tuple(np.round(s.logprobs, 3)) for s in fixed[:3]}) == 3
