"""The Triton decode attention kernels run on the CPU by Triton's interpreter, against the gather path
in float64: sliding windows, logit soft-caps, splits, GQA and the shared-prefix pass. Skipped where
Triton is not importable (PyTorch's CPU wheels lack it); to run them there:

    pip install --target /tmp/triton-site triton==3.6.0 'numpy<2.4'
    PYTHONPATH=/tmp/triton-site:src pytest -q tests/server/attention/test_decode_attention_interpreted.py
"""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest
import torch

from asyncgrpo.server.attention import decode as da
from asyncgrpo.server.attention.shared_prefix import find_shared_prefixes

pytestmark = pytest.mark.engine

# Triton reads TRITON_INTERPRET when it is imported: set here on a machine without CUDA (where no compiled
# kernel can run anyway); with CUDA only when asked for (TRITON_INTERPRET=1), the GPU tests compile theirs
if not torch.cuda.is_available() and "triton" not in sys.modules:
    os.environ["TRITON_INTERPRET"] = "1"
triton = pytest.importorskip("triton")
if not getattr(getattr(getattr(triton, "knobs", None), "runtime", None), "interpret", False):
    pytest.skip("runs under Triton's interpreter: set TRITON_INTERPRET=1", allow_module_level=True)
try:  # Triton 3.6's interpreter turns one-element arrays into loop bounds with int(), which numpy 2.4 refuses
    int(np.zeros(1))
except TypeError:
    pytest.skip("Triton's interpreter needs numpy < 2.4 (pip install --target DIR 'numpy<2.4', put DIR first "
                "on PYTHONPATH)", allow_module_level=True)

BLOCK = 16


def _case(seed: int, lens: list[int], heads: int, kv_heads: int, head_dim: int = 16):
    """Each sequence owns distinct, shuffled blocks (entries past its length point at unrelated ones);
    queries scaled so that the scores reach tens, where soft-caps of 30 and 50 change them."""
    g = torch.Generator().manual_seed(seed)
    nb = -(-max(lens) // BLOCK)
    num_blocks = len(lens) * nb + 2
    k_pool, v_pool = (torch.randn(num_blocks, BLOCK, kv_heads, head_dim, generator=g) for _ in range(2))
    tables = torch.randperm(num_blocks - 1, generator=g)[: len(lens) * nb].view(len(lens), nb)
    q = torch.randn(len(lens), heads, head_dim, generator=g) * 8
    return q, k_pool, v_pool, tables, torch.tensor(lens)


def _behind_windows_poisoned(k_pool, v_pool, tables, lens, window):
    """The pools with a NaN block and the tables pointing every block wholly behind its sequence's window
    there (as the server's released blocks point at its null block): reading one spoils the output."""
    k_pool, v_pool = k_pool.clone(), v_pool.clone()
    k_pool[-1], v_pool[-1] = float("nan"), float("nan")
    first_block = ((lens - window).clamp(min=0) // BLOCK)[:, None]
    behind = torch.arange(tables.shape[1])[None, :] < first_block
    return k_pool, v_pool, torch.where(behind, k_pool.shape[0] - 1, tables)


def _relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert torch.isfinite(out).all()
    return ((out.double() - ref).norm() / ref.norm()).item()


LENS = [1, 2, 3, 15, 16, 17, 64, 100, 257, 300]


@pytest.mark.parametrize("window", [None, 1, 3, 16, 100, 1000])
@pytest.mark.parametrize("softcap", [None, 30.0, 50.0])
def test_windows_and_softcaps_match_the_gather(window, softcap):
    q, k_pool, v_pool, tables, lens = _case(0, LENS, heads=4, kv_heads=2)
    ref = da.decode_attention_gather(q.double(), k_pool.double(), v_pool.double(), tables, lens, 0.25, window,
                                     softcap)
    if window is not None:
        k_pool, v_pool, tables = _behind_windows_poisoned(k_pool, v_pool, tables, lens, window)
    # 21 splits: more partial results than the merge takes at once (16), some of them empty
    for tile, num_splits in [(16, 1), (16, 3), (32, 7)] + [(16, 21)] * (window is None):
        out = da.decode_attention_triton(q, k_pool, v_pool, tables, lens, 0.25,
                                         tile=tile, num_splits=num_splits, window=window, softcap=softcap)
        assert _relative_error(out, ref) < 1e-5, (tile, num_splits)


@pytest.mark.parametrize("heads,kv_heads", [(8, 1), (2, 2)])
def test_window_and_softcap_with_other_head_groups(heads, kv_heads):
    q, k_pool, v_pool, tables, lens = _case(1, [5, 40, 131, 200], heads, kv_heads, head_dim=32)
    ref = da.decode_attention_gather(q.double(), k_pool.double(), v_pool.double(),
                                     tables, lens, 0.2, 37, 30.0)
    out = da.decode_attention_triton(q, k_pool, v_pool, tables, lens, 0.2, tile=16, num_splits=2, window=37,
                                     softcap=30.0)
    assert _relative_error(out, ref) < 1e-5


def test_softcap_in_the_shared_prefix_pass():
    """Groups of sequences whose tables start with the same 5 blocks: the shared pass (with the cap) reads
    them once per group, and the merge equals plain attention over each sequence's own table."""
    g = torch.Generator().manual_seed(2)
    rows, lens, next_block = [], [], 0
    for members in (2, 3, 4):
        prompt = list(range(next_block, next_block + 5))
        next_block += 5
        for _ in range(members):
            own = int(torch.randint(1, 4, (1,), generator=g))
            rows.append(prompt + list(range(next_block, next_block + own)))
            next_block += own
            lens.append((len(rows[-1]) - 1) * BLOCK + int(torch.randint(1, BLOCK + 1, (1,), generator=g)))
    rows.append(list(range(next_block, next_block + 2)))  # one of its own
    next_block += 2
    lens.append(2 * BLOCK)
    width = max(map(len, rows))
    tables = torch.tensor([r + [0] * (width - len(r)) for r in rows])
    lens = torch.tensor(lens)
    k_pool, v_pool = (torch.randn(next_block + 1, BLOCK, 2, 16, generator=g) for _ in range(2))
    q = torch.randn(len(rows), 4, 16, generator=g) * 8
    shared = find_shared_prefixes(tables.numpy(), lens.numpy(), BLOCK, 4, null_block=next_block)
    assert shared is not None and shared.num_groups == 3 and np.all(shared.lens[:-1] > 0)
    ref = da.decode_attention_gather(q.double(), k_pool.double(), v_pool.double(), tables, lens, 0.25,
                                      softcap=30.0)
    for num_splits, num_shared_splits in [(1, 1), (2, 3), (3, 17)]:
        out = da.decode_attention_triton(q, k_pool, v_pool, tables, lens, 0.25,
                                         tile=16, num_splits=num_splits,
                                         shared=shared.to(torch.device("cpu")),
                                         num_shared_splits=num_shared_splits, softcap=30.0)
        assert _relative_error(out, ref) < 1e-5, (num_splits, num_shared_splits)


def test_chunks_after_cached_tokens_as_rows_of_the_kernels():
    """The rows layout of `attention/rows.py`: every token of a chunk after cached tokens is a query of
    the kernels, runs of one sequence's rows reading its cached blocks once; equals the padded layout."""
    from asyncgrpo.server.attention.continued import continued_attention, continued_layout
    from asyncgrpo.server.attention.rows import continued_rows

    g = torch.Generator().manual_seed(4)
    starts, lens = [80, 80, 33, 96], [5, 16, 20, 1]  # group members' last blocks, a chunk from mid-block
    widths = [-(-(s + n) // BLOCK) for s, n in zip(starts, lens)]
    num_blocks = sum(widths) + 1
    order = torch.randperm(num_blocks, generator=g).tolist()
    tables = [order[sum(widths[:b]): sum(widths[: b + 1])] for b in range(len(widths))]
    k_pool, v_pool = (torch.randn(num_blocks + 1, BLOCK, 2, 16, generator=g) for _ in range(2))
    q = torch.randn(4, sum(lens), 16, generator=g) * 4
    padded = continued_layout(BLOCK, num_blocks * BLOCK, lens, starts, tables, q.device)
    ref = continued_attention(q.double(), k_pool.double(), v_pool.double(), padded, 0.25)
    for members in (0, 4, 16):
        rows = continued_rows(BLOCK, num_blocks, lens, starts, tables, q.device, members)
        assert (rows.shared is not None) == (members > 0)
        out = da.decode_attention_triton(q.transpose(0, 1), k_pool, v_pool,
                                         rows.block_tables, rows.context_lens,
                                         0.25, tile=16, shared=rows.shared)
        assert _relative_error(out, ref) < 1e-5, members


def test_a_step_of_decode_rows_and_prompt_rows_in_the_kernels():
    """A graph step with prompt chunks (`step_rows.prompt_rows`): decode rows, two of them a group sharing
    their first blocks, then every token of a fresh prompt, of a group member's last block and of a next
    turn as rows whose runs read their sequence's blocks before them once; equals the gather, row by row."""
    from asyncgrpo.server.sequence import SeqParams, Sequence
    from asyncgrpo.server.step_rows import decode_inputs, prompt_rows

    g = torch.Generator().manual_seed(5)
    num_blocks, width, members = 60, 10, 4
    block_table = torch.randperm(num_blocks, generator=g)[: 6 * width].view(6, width).numpy().copy()
    block_table[1, :5] = block_table[0, :5]  # decode rows 0 and 1: a group over 5 blocks
    params = SeqParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=0, max_tokens=8, min_tokens=0,
                       stop_token_ids=frozenset(), eos_token_id=None, extra_eos_ids=frozenset(), logprobs=0,
                       want_mask=False)
    prefill = []
    for row, (length, start, end) in zip((3, 4, 5), ((20, 0, 20), (85, 80, 85), (150, 97, 140))):
        seq = Sequence(row, f"r{row}", 0, list(range(1, length + 1)), params, 160)
        seq.row, seq.prefill_start, seq.prefill_end = row, start, end
        prefill.append(seq)
    num_tokens = np.array([97, 90, 33])
    dec = decode_inputs(np.array([5, 6, 7]), num_tokens, np.arange(3), block_table, BLOCK)
    dec.shared = find_shared_prefixes(dec.block_tables, num_tokens, BLOCK, members, null_block=num_blocks)
    assert dec.shared is not None
    step = prompt_rows(dec, prefill, block_table, BLOCK, members, num_blocks)
    assert len(step.token_ids) == 3 + 20 + 5 + 43 and step.sample_rows.tolist() == [0, 1, 2, 22, 27]
    assert step.shared.groups.shape[0] > 1
    k_pool, v_pool = (torch.randn(num_blocks + 1, BLOCK, 2, 16, generator=g) for _ in range(2))
    q = torch.randn(len(step.token_ids), 4, 16, generator=g) * 4
    tables, lens = torch.from_numpy(step.block_tables), torch.from_numpy(step.context_lens)
    ref = da.decode_attention_gather(q.double(), k_pool.double(), v_pool.double(), tables, lens, 0.25)
    shared = step.shared.to(q.device)
    for num_splits in (1, 3):
        out = da.decode_attention_triton(q, k_pool, v_pool, tables, lens, 0.25,
                                         tile=16, num_splits=num_splits, shared=shared)
        assert _relative_error(out, ref) < 1e-5, num_splits


@pytest.mark.parametrize("windowed,capped", [(False, False), (True, False), (False, True), (True, True)])
def test_the_load_time_check_passes_each_variant(windowed, capped):
    cpu = torch.device("cpu")
    assert da.triton_matches_gather(cpu, torch.float32, shared_pass=False, windowed=windowed, capped=capped)
    if not windowed:
        assert da.triton_matches_gather(cpu, torch.float32, shared_pass=True, windowed=False, capped=capped)


def test_the_load_time_check_catches_a_wrong_variant(monkeypatch, caplog):
    """A variant whose kernel disagrees with the gather fails its check (and says what is used instead)."""
    right = da.decode_attention_triton

    def uncapped(*args, **kwargs):
        kwargs["softcap"] = None
        return right(*args, **kwargs)

    monkeypatch.setattr(da, "decode_attention_triton", uncapped)
    cpu = torch.device("cpu")
    assert not da.triton_matches_gather(cpu, torch.float32, shared_pass=False, windowed=False, capped=True)
    assert "soft-cap disagrees with the gather path" in caplog.text
    assert da.triton_matches_gather(cpu, torch.float32, shared_pass=False, windowed=True, capped=False)


def test_the_plans_triton_backends_serve_an_engine_as_the_gather_backends_do(monkeypatch):
    """The execution plan's dispatch to the Triton backends, which declare CUDA only: widened to the CPU
    (Triton's interpreter running the kernels), the plan takes them for decode rows, for groups sharing
    their first blocks and for short chunks as rows (after their load-time checks, compiled by its warm-up),
    and an engine serving a GRPO group and a next turn samples what the CPU plan (the gather backends)
    samples."""
    from test_prefix_caching import Harness, _assert_same, _prompt, tiny_qwen3

    from asyncgrpo.server.attention.base import DECODE, ROWS, SHARED, Support
    from asyncgrpo.server.attention.decode import TritonDecode
    from asyncgrpo.server.attention.shared_prefix import TritonSharedDecode

    model = tiny_qwen3()
    first = _prompt(80, 5 * BLOCK + 3)
    work = [(first, seed) for seed in range(3)] + [(first + _prompt(81, 9), 3)]
    rows = {"shared_prefix": True, "continued_rows": True, "max_prompt_rows": 24, "num_blocks": 96}
    gather = Harness(model, caching=True, **rows)
    assert {type(b) for b in gather.runner.plan.backends[DECODE].values()} != {TritonDecode}
    expected = gather.run(work, max_tokens=4)
    monkeypatch.setattr(TritonDecode, "support", Support(graphs=True))
    monkeypatch.setattr(TritonSharedDecode, "support", Support(windows=False, graphs=True))
    triton = Harness(model, caching=True, **rows)
    plan = triton.runner.plan
    assert type(plan.backend(DECODE, (False, False))) is TritonDecode
    assert type(plan.backend(SHARED, (False, False))) is TritonSharedDecode and ROWS in plan.backends
    _assert_same(triton.run(work, max_tokens=4), expected)
    assert any(entries for entries in triton.shared_entries), "decode steps read a group's blocks once"
