"""FSDP2 on CPU: two gloo processes shard a tiny random Qwen3 with `fully_shard` and check

- the gradient of a micro-batch (each rank trains its own row, the loss normalised by the trained
  tokens of both rows and multiplied by the world size, as `AsyncGRPOTrainer.training_step` does)
  equals the one-process gradient of the same two rows;
- `iter_weight_buckets` gathers the full weights on every rank in step, in the sender's chunk plan;
- PEFT: the merged weights gathered from a sharded adapter model equal the one-process merge, and the
  adapter is unmerged afterwards;
- `push_sharded_weights`: rank 0 sends everything, and a push that fails part-way raises on every
  rank without leaving any rank inside a collective.

The ranks run every check once (module fixture) and send their findings back through a queue.
"""

from __future__ import annotations

import multiprocessing as mp
import traceback

import numpy as np
import pytest
import torch

from asyncgrpo.launch import free_port

VOCAB = 96
BUCKET_BYTES = 3000

pytestmark = [pytest.mark.process, pytest.mark.slow, pytest.mark.timeout(300)]  # two torchrun ranks


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_run_rank, args=(rank, port, queue), daemon=True) for rank in (0, 1)]
    for p in procs:
        p.start()
    try:
        replies = {rank: (found, error) for rank, found, error in (queue.get(timeout=240) for _ in procs)}
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    errors = [f"rank {rank}:\n{error}" for rank, (_, error) in sorted(replies.items()) if error]
    assert not errors, "\n".join(errors)
    return [replies[0][0], replies[1][0]]


@pytest.mark.parametrize("layout", ["layers+root", "layers+tail+root"])
def test_two_rank_gradient_equals_the_one_process_gradient_of_the_same_rows(ranks, layout):
    for found in ranks:
        grad = found[f"grad/{layout}"]
        assert grad["num_params"] > 0 and grad["ref_scale"] > 0
        assert grad["max_abs_diff"] <= 1e-5 * grad["ref_scale"] + 1e-7, grad


def test_buckets_hold_the_full_weights_in_the_senders_chunk_plan(ranks):
    zero, one = ranks
    assert zero["buckets/sizes"] == one["buckets/sizes"] == zero["buckets/plan"]
    assert len(zero["buckets/sizes"]) > 2  # small buckets: the model really is split
    assert zero["buckets/max_bytes"] <= BUCKET_BYTES + zero["buckets/largest_tensor"]
    assert zero["buckets/names"] == zero["buckets/reference_names"]
    assert zero["buckets/equal"] and zero["buckets/bf16_equal"]


def test_peft_weights_are_gathered_merged_and_the_adapter_is_unmerged_after(ranks):
    zero = ranks[0]
    assert zero["peft/names"] == zero["peft/reference_names"]
    assert not any("lora_" in name or "base_layer" in name for name in zero["peft/names"])
    assert zero["peft/max_abs_diff"] < 1e-6
    assert zero["peft/unmerged_max_abs_diff"] < 1e-6


def test_rank0_sends_everything_and_a_failed_push_raises_on_every_rank(ranks):
    zero, one = ranks
    assert zero["push/received_equal"] and zero["push/timings"] == one["push/timings"] == {"total_s": 1.0}
    assert zero["push/failure"] == "RuntimeError: the server went away"
    assert "failed on rank 0: RuntimeError: the server went away" in one["push/failure"]
    assert zero["push/after_failure_ok"] and one["push/after_failure_ok"]


# ------------------------------------------------------------------------------------------ the ranks


def _run_rank(rank: int, port: int, queue) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
        found: dict = {}
        for layout in ("layers+root", "layers+tail+root"):
            found[f"grad/{layout}"] = _gradient_check(layout)
        found.update(_bucket_check(rank))
        found.update(_peft_check(rank))
        found.update(_push_check(rank))
        queue.put((rank, found, None))
    except BaseException:
        queue.put((rank, None, traceback.format_exc()))
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _model(tied: bool = True) -> torch.nn.Module:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from asyncgrpo.packing.attention import enable_tree_attention

    config = Qwen3Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=256, tie_word_embeddings=tied,
    )
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(config).float()
    enable_tree_attention(model)
    return model


def _shard(model: torch.nn.Module, layout: str = "layers+root", root: torch.nn.Module | None = None) -> None:
    """`fully_shard` the decoder layers, optionally the tail (embeddings, final norm, LM head, as
    accelerate does) with reshard_after_forward=False, then the root."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from asyncgrpo.train.model_setup import unwrap

    mesh = init_device_mesh("cpu", (2,))
    base = unwrap(model)
    for layer in base.model.layers:
        fully_shard(layer, mesh=mesh)
    if layout == "layers+tail+root":
        fully_shard(
            [base.model.norm, base.model.embed_tokens, base.lm_head], mesh=mesh, reshard_after_forward=False
        )
    fully_shard(root or model, mesh=mesh)


def _rows() -> list[list]:
    """Two rows (one per rank), each a group of three completions sharing a prompt."""
    from asyncgrpo.packing import Sample

    rng = np.random.default_rng(0)
    rows = []
    for group in range(2):
        prompt = rng.integers(0, VOCAB, 6)
        row = []
        for _ in range(3):
            tokens = np.concatenate([prompt, rng.integers(0, VOCAB, int(rng.integers(3, 9)))])
            mask = np.arange(tokens.size) >= prompt.size
            # the sampler's log-probs near a random model's (-log V): importance ratios near 1
            row.append(Sample(tokens, mask, np.where(mask, -np.log(VOCAB), 0.0), float(rng.normal()), group))
        rows.append(row)
    return rows


def _row_loss(model: torch.nn.Module, samples: list, num_trained_tokens_global: int) -> torch.Tensor:
    """`training_step`'s forward and loss for one row."""
    from asyncgrpo.packing import pack_row
    from asyncgrpo.packing.attention import TreeMask, tree_attention_context
    from asyncgrpo.train.logprobs import token_logprobs
    from asyncgrpo.train.loss import policy_loss
    from asyncgrpo.train.model_setup import hidden_states_and_head

    row = pack_row(samples)
    with tree_attention_context(TreeMask.from_row(row, torch.device("cpu"))):
        hidden, head, _ = hidden_states_and_head(model, row.input_ids, row.position_ids)
        logps = token_logprobs(hidden, head.weight, row.pred_index, row.target_ids)
    return policy_loss(
        logps.target_logprobs,
        row.sampler_logprobs,
        row.advantages,
        row.completion_index,
        num_trained_tokens_global=num_trained_tokens_global,
        gradient_accumulation_steps=1,
        score_centering=False,
    ).loss


def _gradient_check(layout: str) -> dict:
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    rows = _rows()
    num_trained = sum(int(s.trained_mask.sum()) for row in rows for s in row)

    reference = _model()
    sum(_row_loss(reference, row, num_trained) for row in rows).backward()
    expected = {name: p.grad for name, p in reference.named_parameters()}

    model = _model()
    model.train()
    _shard(model, layout)
    (_row_loss(model, rows[rank], num_trained) * world).backward()
    diffs = []
    for name, p in model.named_parameters():
        grad = p.grad.full_tensor()
        diffs.append(float((grad - expected[name]).abs().max()))
    scale = max(float(g.abs().max()) for g in expected.values())
    return {"num_params": len(diffs), "max_abs_diff": max(diffs), "ref_scale": scale}


def _bucket_check(rank: int) -> dict:
    from asyncgrpo.sync.packed import plan_chunks
    from asyncgrpo.train.weights.gather import iter_weight_buckets, server_weight_metas, weights_for_server

    reference = list(weights_for_server(_model(), torch.float32))
    model = _model()
    _shard(model)
    metas = server_weight_metas(model, torch.float32)
    plan = plan_chunks([m.nbytes for m in metas], BUCKET_BYTES)
    sizes, gathered, max_bytes = [], [], 0
    for bucket in iter_weight_buckets(model, torch.float32, BUCKET_BYTES):
        sizes.append(len(bucket))
        max_bytes = max(max_bytes, sum(t.numel() * t.element_size() for _, t in bucket))
        gathered.extend(bucket)
    half = list(iter_weight_buckets(model, torch.bfloat16, BUCKET_BYTES))
    found = {"buckets/sizes": sizes, "buckets/plan": [c.stop - c.start for c in plan]}
    if rank == 0:
        found.update({
            "buckets/names": [n for n, _ in gathered],
            "buckets/reference_names": [n for n, _ in reference],
            "buckets/equal": all(torch.equal(a, b) for (_, a), (_, b) in zip(gathered, reference)),
            "buckets/bf16_equal": all(
                torch.equal(a, b.to(torch.bfloat16))
                for (_, a), (_, b) in zip((pair for bucket in half for pair in bucket), reference)
            ),
            "buckets/max_bytes": max_bytes,
            "buckets/largest_tensor": max(m.nbytes for m in metas),
        })
    return found


def _peft_model() -> torch.nn.Module:
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(1)
    # random B as well as A: the merge changes the weights
    return get_peft_model(
        _model(), LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    )


def _peft_check(rank: int) -> dict:
    from asyncgrpo.train.weights.gather import weights_for_server

    reference = list(weights_for_server(_peft_model(), torch.float32))
    model = _peft_model()
    _shard(model, root=model)
    q_proj = model.base_model.model.model.layers[0].self_attn.q_proj.base_layer
    before = q_proj.weight.full_tensor()
    gathered = list(weights_for_server(model, torch.float32))
    after = q_proj.weight.full_tensor()
    if rank != 0:
        return {}
    return {
        "peft/names": [n for n, _ in gathered],
        "peft/reference_names": [n for n, _ in reference],
        "peft/max_abs_diff": max(float((a - b).abs().max()) for (_, a), (_, b) in zip(gathered, reference)),
        "peft/unmerged_max_abs_diff": float((after - before).abs().max()),
    }


def _fake_transport(fail_after: int | None = None):
    """Rank 0's weight transport: takes the tensors as the sender would; can fail after `fail_after`."""
    from asyncgrpo.sync.checksum import tensor_digest
    from asyncgrpo.train.weights.base import FullWeights

    class FakeTransport(FullWeights):
        def __init__(self) -> None:
            super().__init__(torch.float32, bucket_bytes=BUCKET_BYTES)
            self.received: dict[str, str] = {}

        def send(self, named_tensors, *, label, metas=None):
            for i, (name, tensor) in enumerate(named_tensors):
                if i == fail_after:
                    raise RuntimeError("the server went away")
                assert (name, tensor.dtype, tuple(tensor.shape)) == (
                    metas[i].name,
                    metas[i].dtype,
                    metas[i].shape,
                )
                self.received[name] = tensor_digest(tensor)
            return {"total_s": 1.0}

    return FakeTransport()


def _push_check(rank: int) -> dict:
    """Through the transports the trainer holds: a full-weight one on rank 0, `OtherRank` elsewhere."""
    from asyncgrpo.sync.checksum import weights_checksum
    from asyncgrpo.train.weights.base import OtherRank
    from asyncgrpo.train.weights.gather import weights_for_server
    from asyncgrpo.types import WeightVersion

    expected = weights_checksum(weights_for_server(_model(), torch.float32))
    model = _model()
    _shard(model)

    def transport(fail_after: int | None = None):
        return (
            _fake_transport(fail_after) if rank == 0 else OtherRank(torch.float32, bucket_bytes=BUCKET_BYTES)
        )

    first = transport()
    found: dict = {"push/timings": first.push(model, WeightVersion(1))}
    if rank == 0:
        found["push/received_equal"] = first.received == expected
    try:
        transport(fail_after=3).push(model, WeightVersion(2))
        found["push/failure"] = None
    except RuntimeError as exc:
        found["push/failure"] = str(exc) if rank else f"{type(exc).__name__}: {exc}"
    # the group is still in step: the next push goes through
    retry = transport()
    found["push/after_failure_ok"] = (retry.push(model, WeightVersion(3)) == {"total_s": 1.0}
                                      and (rank != 0 or retry.received == expected))
    return found
