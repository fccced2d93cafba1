"""Weight deltas, pure (sync/delta.py): a delta applied to the old tensor gives the new one bit for bit,
the sketch equals a plain evaluation of its polynomial, and the sketch moved by a delta equals the
sketch of the result. The references here are plain Python over the tensors' bytes."""

from __future__ import annotations

import re

import pytest
import torch

from asyncgrpo.sync.delta import (
    SKETCH_BASES,
    SKETCH_PRIME,
    DeltaInfo,
    DeltaUpdate,
    TensorDelta,
    apply_delta,
    delta_wire_metas,
    encode_delta,
    pack_bits,
    read_at,
    sketch_update,
    split_wire,
    tensor_sketch,
    unpack_bits,
)
from asyncgrpo.sync.packed import TensorMeta

DTYPES = [torch.bfloat16, torch.float32, torch.float16, torch.float64, torch.int64, torch.uint8,
          torch.float8_e4m3fn]


def raw(tensor: torch.Tensor) -> bytes:
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def reference_changes(old: torch.Tensor, new: torch.Tensor) -> list[int]:
    """Flat indices of the elements whose bytes differ."""
    size = old.element_size()
    a, b = raw(old), raw(new)
    return [i for i in range(old.numel()) if a[i * size : (i + 1) * size] != b[i * size : (i + 1) * size]]


def reference_sketch(tensor: torch.Tensor) -> tuple[int, ...]:
    """sum_p word_p * r^p mod 2^31 - 1 over little-endian 16-bit words (8-bit for 1-byte dtypes)."""
    data, width = raw(tensor), 1 if tensor.element_size() == 1 else 2
    words = [int.from_bytes(data[i : i + width], "little") for i in range(0, len(data), width)]
    sketch = []
    for r in SKETCH_BASES:
        total, power = 0, 1
        for w in words:
            total, power = (total + w * power) % SKETCH_PRIME, power * r % SKETCH_PRIME
        sketch.append(total)
    return tuple(sketch)


def changed_copy(old: torch.Tensor, num: int, seed: int) -> torch.Tensor:
    """`old` with `num` elements at random positions given new random bits."""
    g = torch.Generator().manual_seed(seed)
    new = old.clone()
    ints = new.view(-1).view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[old.itemsize])
    where = torch.randperm(old.numel(), generator=g)[:num]
    ints[where] = ints[where] ^ torch.randint(1, 100, (num,), generator=g).to(ints.dtype)  # never the same
    return new


def random_tensor(dtype: torch.dtype, shape, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * 10).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_delta_holds_exactly_the_changed_elements_and_applies_to_the_new_tensor_bit_for_bit(dtype):
    old = random_tensor(dtype, (37, 53), seed=1)
    new = changed_copy(old, 40, seed=2)
    delta = encode_delta(old, new)
    assert delta.indices.tolist() == reference_changes(old, new)
    assert delta.indices.dtype == torch.int32 and delta.values.dtype == dtype
    assert raw(delta.values) == raw(new.reshape(-1)[delta.indices.long()])
    assert delta.nbytes == 40 * (4 + new.element_size())
    applied = old.clone()
    apply_delta(applied, delta)
    assert raw(applied) == raw(new)


def test_signed_zeros_and_nan_payloads_are_different_words():
    old = torch.tensor([0.0, float("nan"), 1.0, 2.0, 3.0, 4.0, 5.0, 6.0], dtype=torch.bfloat16)
    new = old.clone()
    new[0] = -0.0
    new.view(torch.int16)[1] ^= 1  # another NaN
    delta = encode_delta(old, new)
    assert delta.indices.tolist() == [0, 1]
    applied = old.clone()
    apply_delta(applied, delta)
    assert raw(applied) == raw(new)


def test_an_unchanged_tensor_gives_an_empty_delta_that_changes_nothing():
    old = random_tensor(torch.bfloat16, (16, 8), seed=3)
    delta = encode_delta(old, old.clone())
    assert delta.num_changed == 0 and delta.nbytes == 0
    applied = old.clone()
    apply_delta(applied, delta)
    assert raw(applied) == raw(old)
    assert sketch_update(tensor_sketch(old), delta.indices, read_at(old, delta.indices), delta.values,
                         old.numel()) == tensor_sketch(old)


@pytest.mark.parametrize("dtype,whole_from", [(torch.bfloat16, 300), (torch.float32, 310)])
def test_positions_travel_as_indices_then_a_bitmask_then_the_whole_tensor_as_more_changes(dtype, whole_from):
    old = random_tensor(dtype, (320,), seed=4)
    size = old.element_size()
    # indices: 4 + size bytes a change; bitmask: 40 bytes + size a change; whole: 320 * size bytes
    for num, form, nbytes in ((10, "indices", 10 * (4 + size)), (11, "bitmask", 40 + 11 * size),
                              (whole_from - 1, "bitmask", 40 + (whole_from - 1) * size),
                              (whole_from, "whole", 320 * size), (320, "whole", 320 * size)):
        new = changed_copy(old, num, seed=num)
        delta = encode_delta(old, new)
        assert delta.nbytes == nbytes, (num, form)
        assert (delta.indices is None) == (form == "whole")
        assert (delta.bitmask is not None) == (form == "bitmask")
        if form == "bitmask":
            assert delta.indices.tolist() == unpack_bits(delta.bitmask, 320).nonzero().view(-1).tolist()
        applied = old.clone()
        apply_delta(applied, delta)
        assert raw(applied) == raw(new), (num, form)


@pytest.mark.parametrize("numel", [1, 7, 8, 9, 1000])
def test_a_bitmask_holds_element_8i_plus_j_in_bit_j_of_byte_i(numel):
    mask = torch.rand(numel, generator=torch.Generator().manual_seed(numel)) < 0.3
    bits = pack_bits(mask)
    assert bits.dtype == torch.uint8 and bits.numel() == -(-numel // 8)
    assert bits.tolist() == [sum(int(mask[8 * i + j]) << j for j in range(8) if 8 * i + j < numel)
                             for i in range(bits.numel())]
    assert torch.equal(unpack_bits(bits, numel), mask)


def test_a_delta_writes_into_a_strided_view_in_place():
    base = random_tensor(torch.bfloat16, (12, 10), seed=7)
    view = base.t()  # not contiguous: the parameter a server holds may be such a view
    new = changed_copy(view.contiguous(), 9, seed=8)
    delta = encode_delta(view, new)
    storage = base.data_ptr()
    apply_delta(view, delta)
    assert raw(view) == raw(new) and base.data_ptr() == storage and raw(base) == raw(new.t())


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_sketch_is_the_polynomial_of_the_words(dtype):
    words_per_element = max(1, dtype.itemsize // 2)
    tensor = random_tensor(dtype, (70_001 // words_per_element,), seed=9)  # past 2^16 words: two table levels
    assert tensor_sketch(tensor) == reference_sketch(tensor)
    flipped = tensor.clone()
    flipped.view(-1).view(torch.uint8)[12_345] ^= 4  # one bit
    assert tensor_sketch(flipped) != tensor_sketch(tensor)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64, torch.uint8])
def test_a_sketch_moved_by_a_delta_is_the_sketch_of_the_result(dtype):
    old = random_tensor(dtype, (3_000_001 // dtype.itemsize,), seed=10)  # more than one block of 2^20 words
    new = changed_copy(old, 500, seed=11)
    new.view(-1)[-1:] = old.view(-1)[-1:] + 1  # the last word too
    delta = encode_delta(old, new)
    moved = sketch_update(tensor_sketch(old), delta.indices, read_at(old, delta.indices), delta.values,
                          old.numel())
    assert moved == tensor_sketch(new)


def test_a_delta_update_describes_its_wire_and_splits_back_into_the_deltas():
    metas = [TensorMeta("a", torch.bfloat16, (16, 16)), TensorMeta("b", torch.float32, (3,)),
             TensorMeta("c", torch.bfloat16, (5,)), TensorMeta("d", torch.bfloat16, (100,))]
    old = [random_tensor(m.dtype, m.shape, seed=i) for i, m in enumerate(metas)]
    new = [changed_copy(old[0], 2, seed=20), changed_copy(old[1], 3, seed=21), old[2].clone(),
           changed_copy(old[3], 30, seed=22)]
    deltas = tuple(encode_delta(o, n) for o, n in zip(old, new))
    update = DeltaUpdate(tuple(metas), deltas, tuple(tensor_sketch(n) for n in new), base_version="v3")
    info = update.update_info()
    assert info["names"] == ["a", "b", "c", "d"] and info["shapes"] == [[16, 16], [3], [5], [100]]
    assert info["delta"]["base_version"] == "v3" and info["delta"]["num_changed"] == [2, -1, 0, 30]
    assert info["delta"]["bitmask"] == [False, False, False, True]
    parsed = DeltaInfo.from_json(info["delta"], metas)
    assert parsed == update.info
    wire_metas = delta_wire_metas(metas, parsed)
    assert [(m.name, m.dtype, m.shape) for m in wire_metas] == [
        ("a.indices", torch.int32, (2,)), ("a.values", torch.bfloat16, (2,)), ("b", torch.float32, (3,)),
        ("d.bitmask", torch.uint8, (13,)), ("d.values", torch.bfloat16, (30,))]
    assert [(name, t.dtype, tuple(t.shape)) for name, t in update.wire()] == [
        (m.name, m.dtype, m.shape) for m in wire_metas]
    assert update.nbytes == 2 * 6 + 12 + 13 + 60 and update.full_nbytes == 512 + 12 + 10 + 200
    back = list(split_wire(metas, parsed, (t for _, t in update.wire())))
    assert [m.name for m, _ in back] == ["a", "b", "d"]
    position = {m.name: i for i, m in enumerate(metas)}
    for meta, delta in back:
        applied = old[position[meta.name]].clone()
        apply_delta(applied, delta)
        assert raw(applied) == raw(new[position[meta.name]]), meta.name


GOOD = {"base_version": "v1", "num_changed": [1], "bitmask": [False], "sketches": [[0, 0]]}


@pytest.mark.parametrize("bad,words", [
    ({"base_version": 3}, "'base_version' must be a string"),
    ({"num_changed": [0, 0]}, "2 num_changed, 1 bitmask and 1 sketches for 1 tensors"),
    ({"num_changed": [5]}, "num_changed for 'w' must be -1 or 0..4"),
    ({"bitmask": [1]}, "bitmask for 'w' must be a boolean"),
    ({"sketches": [[0, SKETCH_PRIME]]}, "the sketch of 'w' must be 2 integers in"),
    ({"extra": 1}, "exactly the keys"),
])
def test_a_malformed_delta_description_is_refused_naming_what_is_wrong(bad, words):
    with pytest.raises(ValueError, match="Invalid update_info: delta: .*" + re.escape(words)):
        DeltaInfo.from_json({**GOOD, **bad}, [TensorMeta("w", torch.bfloat16, (4,))])
    assert DeltaInfo.from_json(GOOD, [TensorMeta("w", torch.bfloat16, (4,))]).num_changed == (1,)


def test_a_whole_tensor_delta_of_another_size_is_refused():
    with pytest.raises(ValueError, match="whole-tensor delta of 3 elements"):
        apply_delta(torch.zeros(4), TensorDelta(None, torch.zeros(3)))
