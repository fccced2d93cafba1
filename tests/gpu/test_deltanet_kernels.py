r"""Gated DeltaNet on tree-packed rows, CUDA: fla-core's Triton delta rule (the "fla" backend) against
the PyTorch chunked one and against each sample alone through the same kernel, forward and backward.

fla-core is optional; where it is missing these tests fail saying so. Offline, install its wheel first:

    pip download --no-deps --only-binary=:all: --python-version 3.12 \
        --platform manylinux_2_28_x86_64 fla-core -d .whl/
    pip install --no-deps .whl/fla_core-*.whl        # on the GPU machine
    pytest -m gpu tests/gpu/test_deltanet_kernels.py

On a machine where fla-core has not run yet, the first run compiles and tunes its kernels (minutes).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from asyncgrpo.packing import Sample, pack_row, sample_paths
from asyncgrpo.packing.attention import TreeMask, enable_tree_attention, tree_attention_context
from asyncgrpo.packing.recurrent import (
    RecurrentLayout,
    _fla_kernel,
    _fla_training_problem,
    resolve_delta_rule_backend,
    tree_gated_delta_rule,
)

# fla-core's first use of a shape compiles and tunes its kernels: more than the suite's 300 s per test
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
              pytest.mark.timeout(900)]

VOCAB = 1000


def tree_samples(rng: np.random.Generator, groups: int = 3, prompt: int = 300) -> list[Sample]:
    """GRPO groups (completions of 1 to 700 tokens), a multi-turn fork, forks after one and two tokens."""
    def tokens(n):
        return [int(t) for t in rng.integers(0, VOCAB, n)]

    samples = []

    def add(context, completion):
        ids = context + completion
        mask = [False] * len(context) + [True] * len(completion)
        samples.append(Sample(ids, mask, [-7.0 if m else 0.0 for m in mask],
                              float(rng.normal()), len(samples) % 7))

    for _ in range(groups):
        p = tokens(prompt)
        completions = [tokens(int(n)) for n in rng.integers(1, 700, 6)]
        for c in completions:
            add(p, c)
        add(p + completions[0] + tokens(20), tokens(150))  # turn 2
        add(p[:1], tokens(40))
        add(p[:2], tokens(3))
    return samples


def delta_rule_inputs(num_tokens: int, key_heads: int, heads: int, dim: int, dtype, seed: int):
    """Inputs distributed like a Gated DeltaNet layer's: decays exp(g) from about 1e-7 to 0.99."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(num_tokens, key_heads, dim, device="cuda", generator=gen).to(dtype)
    k = torch.randn(num_tokens, key_heads, dim, device="cuda", generator=gen).to(dtype)
    v = torch.randn(num_tokens, heads, dim, device="cuda", generator=gen).to(dtype)
    a_log = torch.empty(heads, device="cuda").uniform_(0.01, 16, generator=gen).log()
    a = torch.randn(num_tokens, heads, device="cuda", generator=gen)
    g = -a_log.exp() * F.softplus(a + 1.0)  # float32, as the layers compute it
    beta = torch.sigmoid(torch.randn(num_tokens, heads, device="cuda", generator=gen)).to(dtype)
    return [x.requires_grad_() for x in (q, k, v, g, beta)]


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).norm() / want.float().norm().clamp_min(1e-30))


# relative (norm) errors; a segment started from the wrong state is off by O(0.1 - 1). fla's fp32 path
# multiplies in TF32, its bf16 path keeps intermediates in bf16. fla-core tunes its kernels once per
# (value heads, head size, dtype), about a minute each on an H200, so the cases share those: Qwen3.5-2B's
# heads (which bench/packing.py and the trainer tune too), and 2 value heads of 64 (grouped: one q/k head),
# the shape of `tiny_qwen35` and the training check's default.
@pytest.mark.parametrize("dtype,tol,key_heads,heads,dim", [
    (torch.bfloat16, 3e-2, 16, 16, 128), (torch.bfloat16, 3e-2, 1, 2, 64), (torch.float32, 1e-2, 1, 2, 64)])
def test_fla_tree_delta_rule_matches_the_torch_path_and_each_sample_alone(dtype, tol, key_heads, heads, dim):
    kernel, reason = _fla_kernel()
    assert kernel is not None, f"install fla-core (module docstring): {reason}"
    train = _fla_training_problem(torch.cuda.current_device()) is None
    row = pack_row(tree_samples(np.random.default_rng(0))).to("cuda")
    layout = RecurrentLayout.build(row.segment_parent, row.segment_start, row.segment_len, 4, "cuda")
    assert len(layout.levels) >= 3 and row.num_tokens > 4000
    inputs = delta_rule_inputs(row.num_tokens, key_heads, heads, dim, dtype, seed=1)
    weight = torch.randn(row.num_tokens, heads, dim, device="cuda")

    results = {}
    for backend in ("fla", "torch"):
        out = tree_gated_delta_rule(*inputs, layout, backend=backend)
        grads = torch.autograd.grad((out.float() * weight).sum(), inputs) if train else None
        results[backend] = (out.detach(), grads)
    fla_out, fla_grads = results["fla"]
    torch_out, torch_grads = results["torch"]
    assert relative_error(fla_out, torch_out) < tol
    if train:
        for name, got, want in zip(("q", "k", "v", "g", "beta"), fla_grads, torch_grads):
            assert relative_error(got, want) < 2 * tol, name

    # each sample alone, plain varlen through the same kernel: the tree changes nothing on its path
    paths = sample_paths(row.to("cpu"))
    index = torch.as_tensor(np.concatenate(paths), device="cuda")
    lengths = torch.as_tensor([0] + [len(p) for p in paths], device="cuda").cumsum(0)
    alone_layout = RecurrentLayout.build(torch.full((len(paths),), -1), lengths[:-1],
                                         lengths.diff(), 4, "cuda")
    alone = tree_gated_delta_rule(*(x.detach()[index] for x in inputs), alone_layout, backend="fla")
    assert relative_error(fla_out[index], alone) < tol
    if not train:
        pytest.skip("forward checked; backward not: fla-core cannot train on this GPU "
                    f"({_fla_training_problem(torch.cuda.current_device())})")


def test_torch_delta_rule_on_cuda_equals_float64_on_the_cpu():
    """The PyTorch backend's CUDA kernels (batched matmuls of the blocked inverse with hundreds of
    thousands of tiny blocks, index_select gathers and their index_add_ backward) against the same
    row in float64 on the CPU, forward and gradients, at Qwen3.5-2B's head shape. fla-core not needed."""
    row = pack_row(tree_samples(np.random.default_rng(3), groups=6)).to("cuda")
    layout = RecurrentLayout.build(row.segment_parent, row.segment_start, row.segment_len, 4, "cuda")
    assert layout.chunks.num_chunks * 16 * 32 > 65535  # the first doubling step's batch of 1 x 1 blocks
    inputs = delta_rule_inputs(row.num_tokens, 16, 16, 128, torch.float32, seed=4)
    weight = torch.randn(row.num_tokens, 16, 128, device="cuda")
    out = tree_gated_delta_rule(*inputs, layout, backend="torch")
    grads = torch.autograd.grad((out * weight).sum(), inputs)

    cpu = row.to("cpu")
    cpu_layout = RecurrentLayout.build(cpu.segment_parent, cpu.segment_start, cpu.segment_len, 4)
    cpu_inputs = [x.detach().cpu().double().requires_grad_() for x in inputs]
    want = tree_gated_delta_rule(*cpu_inputs, cpu_layout, backend="torch")
    want_grads = torch.autograd.grad((want * weight.cpu().double()).sum(), cpu_inputs)
    assert relative_error(out.cpu(), want) < 1e-4
    for name, got, expected in zip(("q", "k", "v", "g", "beta"), grads, want_grads):
        assert relative_error(got.cpu(), expected) < 1e-4, name


def test_auto_backend_trains_with_fla_only_where_its_backward_runs():
    """Where fla-core refuses the backward pass (Triton 3.4 to 3.7.0 on Hopper), "auto" takes the
    PyTorch delta rule instead of failing in the first training step."""
    problem = _fla_training_problem(torch.cuda.current_device())
    assert resolve_delta_rule_backend("auto", torch.device("cuda")) == ("fla" if problem is None else "torch")


def tiny_qwen35(hidden: int = 512):
    from transformers import AutoModelForCausalLM
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    config = CONFIG_MAPPING["qwen3_5_text"](
        vocab_size=VOCAB, hidden_size=hidden, intermediate_size=2 * hidden,
        num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=128, linear_num_key_heads=2,
        linear_num_value_heads=2, linear_key_head_dim=64,
        linear_value_head_dim=64, max_position_embeddings=8192, attention_dropout=0.0)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.bfloat16).cuda()


def test_bf16_hybrid_model_fla_and_torch_paths_agree_with_unpacked():
    """A Qwen3.5-shaped model in bf16: packed log-probs and gradients with either delta rule, and the
    unpacked forward (transformers, fla where installed). A wrong state or conv window moves log-probs
    by O(0.1) at these widths; bf16 rounding by about 1e-2."""
    model = tiny_qwen35()
    samples = tree_samples(np.random.default_rng(2), groups=2, prompt=100)[:12]
    row = pack_row(samples).to("cuda")
    reference = []
    with torch.no_grad():
        for s in samples:
            ids = torch.as_tensor(s.token_ids, dtype=torch.long, device="cuda")[None]
            t = torch.as_tensor(np.flatnonzero(s.trained_mask), device="cuda")
            logits = model(input_ids=ids, use_cache=False).logits[0, t - 1].float()
            reference.append(torch.log_softmax(logits, -1).gather(-1, ids[0, t, None])[:, 0])
    reference = torch.cat(reference)

    enable_tree_attention(model)
    trainable = _fla_training_problem(torch.cuda.current_device()) is None
    results = {}
    for backend in ("torch", "fla") if trainable else ("torch",):
        model.zero_grad()
        with tree_attention_context(TreeMask.from_row(row, backend="dense", deltanet_backend=backend)):
            hidden = model.model(input_ids=row.input_ids[None],
                                 position_ids=row.position_ids[None]).last_hidden_state
        logits = model.lm_head(hidden[0, row.pred_index]).float()
        lp = torch.log_softmax(logits, -1).gather(-1, row.target_ids[:, None])[:, 0]
        (lp * row.advantages.cuda()).sum().backward()
        a_log = model.model.layers[0].linear_attn.A_log.grad.float().clone()
        results[backend] = (lp.detach(), model.model.embed_tokens.weight.grad.float().clone(), a_log)
    for backend, (lp, _, _) in results.items():
        torch.testing.assert_close(lp, reference, atol=3e-2, rtol=0, msg=lambda m, b=backend: f"{b}: {m}")
    if not trainable:
        pytest.skip("the PyTorch path checked; fla-core cannot train on this GPU "
                    f"({_fla_training_problem(torch.cuda.current_device())})")
    torch.testing.assert_close(results["fla"][0], results["torch"][0], atol=3e-2, rtol=0)
    for i in (1, 2):
        assert relative_error(results["fla"][i], results["torch"][i]) < 5e-2
