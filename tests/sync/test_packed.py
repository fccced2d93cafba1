"""The packed weight-transfer layout against a plain reference (vllm-protocol.md 5.4)."""

from __future__ import annotations

import base64
import random

import numpy as np
import pytest
import torch

from asyncgrpo.sync.packed import (
    Chunk,
    TensorMeta,
    TransferInit,
    dtype_name,
    iter_packed_chunks,
    metas_from_update_info,
    pack,
    plan_chunks,
    unpack,
    update_info_from_metas,
)


def reference_chunks(sizes: list[int], buffer_size: int) -> list[list[int]]:
    """vLLM's producer loop, transcribed: indexes of the tensors of each broadcast."""
    chunks, current, total = [], [], 0
    for i, size in enumerate(sizes):
        current.append(i)
        total += size
        if total > buffer_size:
            chunks.append(current)
            current, total = [], 0
    if current:
        chunks.append(current)
    return chunks


def reference_bytes(tensors: list[torch.Tensor]) -> bytes:
    """Row-major little-endian bytes of each tensor, concatenated (via numpy, not torch views)."""
    out = b""
    for t in tensors:
        if t.dtype == torch.bfloat16:  # numpy has no bfloat16: its bits are the top half of float32
            bits = (t.float().contiguous().numpy().view(np.uint32) >> 16).astype("<u2")
            out += bits.tobytes()
        else:
            out += t.contiguous().numpy().astype(t.numpy().dtype.newbyteorder("<")).tobytes()
    return out


def test_tensor_exactly_at_buffer_size_keeps_the_chunk_open():
    assert plan_chunks([4, 4], 8) == [Chunk(0, 2, (0, 4), 8)]
    assert plan_chunks([8, 1, 3], 8) == [Chunk(0, 2, (0, 8), 9), Chunk(2, 3, (0,), 3)]


def test_crossing_tensor_stays_in_the_chunk_it_crossed():
    assert plan_chunks([5, 10, 2], 8) == [Chunk(0, 2, (0, 5), 15), Chunk(2, 3, (0,), 2)]
    assert plan_chunks([100], 8) == [Chunk(0, 1, (0,), 100)]


def test_empty_tensors_are_entries_and_a_trailing_empty_chunk_is_sent():
    assert plan_chunks([0, 9, 0], 8) == [Chunk(0, 2, (0, 0), 9), Chunk(2, 3, (0,), 0)]
    assert plan_chunks([0], 8) == [Chunk(0, 1, (0,), 0)]
    assert plan_chunks([], 8) == []


def test_plan_matches_reference_on_random_sizes():
    rng = random.Random(0)
    for _ in range(500):
        sizes = [
            rng.choice([0, 1, 2, 4, 7, 8, 16, 33, rng.randrange(0, 200)]) for _ in range(rng.randrange(0, 30))
        ]
        buffer_size = rng.choice([1, 8, 16, 64, 100])
        plan = plan_chunks(sizes, buffer_size)
        assert [list(range(c.start, c.stop)) for c in plan] == reference_chunks(sizes, buffer_size)
        for c in plan:
            chunk_sizes = sizes[c.start : c.stop]
            assert c.nbytes == sum(chunk_sizes)
            assert list(c.offsets) == list(np.cumsum([0] + chunk_sizes[:-1]))


def _mixed_tensors() -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [
        ("model.embed_tokens.weight", torch.randn(7, 3, generator=g).to(torch.bfloat16)),
        ("scalar", torch.tensor(3.5, dtype=torch.float32)),  # 0-d: one element
        ("empty", torch.empty(0, 4, dtype=torch.float16)),  # 0 bytes, still an entry
        ("ints", torch.arange(-5, 6, dtype=torch.int64).reshape(11, 1)),
        (
            "bytes",
            torch.randint(0, 255, (13,), dtype=torch.uint8, generator=g),
        ),  # odd size: later offsets misalign
        ("half", torch.randn(2, 3, 5, generator=g).to(torch.float16)),
        ("transposed", torch.randn(4, 6, generator=g).t()),  # non-contiguous source
    ]


@pytest.mark.parametrize("buffer_size", [1, 16, 64, 10_000])
def test_pack_is_byte_exact_and_unpack_round_trips(buffer_size):
    named = _mixed_tensors()
    metas = [TensorMeta.of(n, t) for n, t in named]
    assert metas[1].numel == 1 and metas[1].nbytes == 4 and metas[2].nbytes == 0
    chunks = list(iter_packed_chunks(metas, iter(named), buffer_size, torch.device("cpu")))
    plan = plan_chunks([m.nbytes for m in metas], buffer_size)
    assert len(chunks) == len(plan)
    assert b"".join(bytes(c.numpy()) for c in chunks) == reference_bytes([t for _, t in named])
    received = []
    for chunk, buffer in zip(plan, chunks):
        assert buffer.dtype == torch.uint8 and buffer.numel() == chunk.nbytes
        received += unpack(buffer, metas[chunk.start : chunk.stop], chunk.offsets)
    for (name, sent), got, meta in zip(named, received, metas):
        assert got.dtype == sent.dtype and tuple(got.shape) == meta.shape, name
        assert torch.equal(got, sent), name


def test_unpack_views_aligned_tensors_in_place():
    a, b = torch.arange(4, dtype=torch.float32), torch.arange(3, dtype=torch.int64)
    metas = [TensorMeta.of("a", a), TensorMeta.of("b", b)]
    buffer = pack([a, b])
    got_a, got_b = unpack(buffer, metas, (0, 16))
    assert got_a.data_ptr() == buffer.data_ptr() and got_b.data_ptr() == buffer.data_ptr() + 16
    assert torch.equal(got_a, a) and torch.equal(got_b, b)


def test_iterator_must_match_the_announced_metadata():
    named = _mixed_tensors()
    metas = [TensorMeta.of(n, t) for n, t in named]
    with pytest.raises(ValueError, match="announced 'scalar'"):
        list(
            iter_packed_chunks(
                metas,
                [named[0], ("scalar", torch.tensor(1.0, dtype=torch.float64))],
                1 << 20,
                torch.device("cpu"),
            )
        )
    with pytest.raises(ValueError, match="ended before"):
        list(iter_packed_chunks(metas, named[:3], 1, torch.device("cpu")))
    with pytest.raises(ValueError, match="more than"):
        list(iter_packed_chunks(metas[:2], named, 1 << 20, torch.device("cpu")))


def test_update_info_round_trip_and_validation():
    named = _mixed_tensors()
    metas = [TensorMeta.of(n, t) for n, t in named]
    info = update_info_from_metas(metas)
    assert info["dtype_names"][:3] == ["bfloat16", "float32", "float16"]
    assert info["shapes"][1] == [] and info["shapes"][2] == [0, 4]
    assert metas_from_update_info(info) == metas
    assert metas_from_update_info({"names": [], "dtype_names": [], "shapes": []}) == []
    bad = [
        ({**info, "names": info["names"][:-1]}, "lengths differ"),
        ({**info, "dtype_names": ["complex64"] * len(metas)}, "complex64"),
        ({**info, "shapes": [[-1]] * len(metas)}, "non-negative"),
        ({**info, "names": ["x"] * len(metas)}, "unique"),
        ({**info, "packed": True}, "keys must be exactly"),
        ([info], "list form"),
    ]
    for body, pattern in bad:
        with pytest.raises(ValueError, match=f"Invalid update_info: .*{pattern}"):
            metas_from_update_info(body)
    with pytest.raises(ValueError, match="cannot be sent"):
        dtype_name(torch.complex64)


def test_transfer_init_round_trip_and_validation():
    uid = bytes(range(128))
    nccl = TransferInit("nccl", 2, nccl_unique_id=uid, buffer_size_bytes=4096).to_init_info()
    assert nccl == {
        "nccl_unique_id_b64": base64.b64encode(uid).decode(),
        "rank_offset": 1,
        "world_size": 2,
        "packed": True,
        "packed_buffer_size_bytes": 4096,
        "packed_num_buffers": 2,
    }
    assert TransferInit.from_init_info(nccl).nccl_unique_id == uid
    gloo = TransferInit("gloo", 3, master_address="127.0.0.1", master_port=1234, packed=False).to_init_info()
    assert gloo == {
        "backend": "gloo",
        "master_address": "127.0.0.1",
        "master_port": 1234,
        "rank_offset": 1,
        "world_size": 3,
        "packed": False,
    }
    parsed = TransferInit.from_init_info(gloo)
    assert (parsed.backend, parsed.world_size, parsed.packed, parsed.master_port) == ("gloo", 3, False, 1234)
    bad = [
        ({**nccl, "extra": 1}, "unknown key"),
        ({**nccl, "nccl_unique_id_b64": "abc"}, "base64|bytes"),
        ({**nccl, "master_address": "h", "master_port": 1}, "exactly one rendezvous"),
        ({k: v for k, v in nccl.items() if k != "nccl_unique_id_b64"}, "nccl_unique_id_b64"),
        ({**nccl, "world_size": 1}, "world_size"),
        ({**nccl, "rank_offset": 2}, "rank_offset"),
        ({**gloo, "master_port": "x"}, "master_port"),
        ({**gloo, "nccl_unique_id_b64": "x"}, "unknown key"),
        ({**gloo, "backend": "mpi"}, "backend"),
        ([], "object"),
    ]
    for info, pattern in bad:
        with pytest.raises(ValueError, match=f"Invalid init_info: .*({pattern})"):
            TransferInit.from_init_info(info)
