"""Weight deltas: a push of only the words that changed since the last push, and the sketch that lets the
server check it ends with exactly the trainer's weights. Pure: tensors in, tensors and ints out.

At the learning rates of RL fine-tuning one optimizer step changes 0.5-3% of a model's bf16 words (the
float32 master weights move less than a bf16 word's spacing; docs/performance.md, "How much of a push is
new"), so a push of the changed words alone is a few percent of the full one.

    encode_delta(old, new)   per tensor, compared bitwise: the new values of the changed elements and
                             their positions, as flat indices (int32; int64 past 2^31 elements) or,
                             when smaller, a bitmask of one bit per element (past 1/32 of bf16 words
                             changed); or the whole tensor when that is not larger (past 15/16 of bf16
                             words changed)
    apply_delta(t, delta)    writes it into `t` in place (the server's parameters keep their storage)
    tensor_sketch(t)         two residues mod 2^31 - 1 of the tensor's bits (see below)
    sketch_update(...)       the sketch after a delta, from the changed words alone

The wire (an embedded-server extension of `update_info`; vLLM knows none of it). `names`, `dtype_names`
and `shapes` describe every tensor of the update as in a full update, plus

    "delta": {"base_version": str,          the weight version the delta applies to
              "num_changed": [int],         per tensor: k > 0 changed elements sent, 0 unchanged (nothing
                                            sent), -1 the whole tensor sent
              "bitmask": [bool],            per tensor: the positions travel as a bitmask (else indices)
              "sketches": [[int, int]]}     per tensor: the sketch of the tensor once the delta is applied

and the broadcast carries, in `names` order, packed by the usual chunk rules (`packed.py`), for k > 0
`<name>.indices` (k indices) or `<name>.bitmask` (uint8, element 8i + j in bit j of byte i), then
`<name>.values` (k elements of the tensor's dtype), for -1 the tensor itself, for 0 nothing
(`delta_wire_metas`). A server that holds another base version, or whose
tensors' sketches differ from the announced ones once the delta is applied, rejects the update after
receiving all of it (so the group stays in step); the trainer then pushes the full weights.

The sketch of a tensor whose bytes, read as unsigned 16-bit words (8-bit for 1-byte dtypes; a wider
element is several words, low first), are x_0 .. x_{n-1} is, for two fixed bases r,
`sum_p x_p * r^p mod P` with P = 2^31 - 1: a polynomial hash, two residues of 31 bits, that differs
between two different tensors but for a chance of about 2^-62 (errors that do not aim at it), and
that a delta moves by its changed words alone: each side computes it over a whole tensor once after
a full push, then in O(changed words). The powers of r come from three tables of 2^16 entries
(positions up to 2^48 words).
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from asyncgrpo.sync.packed import TensorMeta, dtype_name

SKETCH_PRIME = (1 << 31) - 1
"""Mersenne: a residue is taken with shifts and masks, which every device runs vectorised."""
SKETCH_BASES = (1_220_703_125, 1_103_515_245)
"""Two fixed points the polynomial is evaluated at (any values in [2, P - 2] would do)."""

_TABLE_BITS = 16
_TABLE_SIZE = 1 << _TABLE_BITS
_LEVELS = 3  # positions < 2^48 words
_BLOCK_WORDS = 1 << 20  # words per step of a sketch: bounds its temporaries (8 MB each)

_INT_VIEWS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}

Sketch = tuple[int, int]


@dataclass(frozen=True)
class TensorDelta:
    """What one tensor's push carries. `indices` (int32 or int64, ascending) are the flat positions of
    the changed elements and `values` (1-d, the tensor's dtype) their new values; `indices` None means
    `values` is the whole new tensor (a delta would not have been smaller). `bitmask`, when not None, is
    how the positions travel: one bit per element (`pack_bits`) instead of the indices, when smaller."""

    indices: torch.Tensor | None
    values: torch.Tensor
    bitmask: torch.Tensor | None = None

    @property
    def num_changed(self) -> int:
        """The wire's `num_changed`: k changed elements sent, 0 for none, -1 for the whole tensor."""
        return -1 if self.indices is None else self.indices.numel()

    @property
    def positions(self) -> torch.Tensor | None:
        """What carries the positions on the wire: the bitmask, the indices, or None (the whole tensor)."""
        return self.bitmask if self.bitmask is not None else self.indices

    @property
    def nbytes(self) -> int:
        """Bytes on the wire."""
        sent = self.values.numel() * self.values.element_size()
        positions = self.positions
        return sent if positions is None else sent + positions.numel() * positions.element_size()


def index_dtype(numel: int) -> torch.dtype:
    """The dtype of a tensor's delta indices: int32 while every flat position fits, else int64."""
    return torch.int32 if numel <= torch.iinfo(torch.int32).max else torch.int64


def bitmask_nbytes(numel: int) -> int:
    """Bytes of a bitmask over `numel` elements."""
    return -(-numel // 8)


def delta_form(num_changed: int, numel: int, dtype: torch.dtype) -> str:
    """How a tensor with `num_changed` changed elements travels most cheaply: "indices" (an index and a
    value each), "bitmask" (a bit per element and a value each) or "whole" (the tensor)."""
    sizes = {"indices": num_changed * (index_dtype(numel).itemsize + dtype.itemsize),
             "bitmask": bitmask_nbytes(numel) + num_changed * dtype.itemsize}
    form = min(sizes, key=sizes.__getitem__)
    return form if sizes[form] < numel * dtype.itemsize or not num_changed else "whole"


_BIT_SHIFTS = tuple(range(8))


def pack_bits(mask: torch.Tensor) -> torch.Tensor:
    """A flat bool mask as uint8 bytes, element 8i + j in bit j of byte i (the last byte zero-padded)."""
    padded = torch.nn.functional.pad(mask.reshape(-1).to(torch.uint8), (0, -mask.numel() % 8)).view(-1, 8)
    shifts = torch.tensor(_BIT_SHIFTS, dtype=torch.uint8, device=mask.device)
    return (padded << shifts).sum(dim=1, dtype=torch.uint8)  # distinct bits: the sum is their OR


def unpack_bits(bits: torch.Tensor, numel: int) -> torch.Tensor:
    """Inverse of `pack_bits`: the flat bool mask of `numel` elements."""
    shifts = torch.tensor(_BIT_SHIFTS, dtype=torch.uint8, device=bits.device)
    return ((bits.view(-1, 1) >> shifts) & 1).view(-1)[:numel].bool()


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's elements as flat signed integers of the same width (bitwise: -0.0 != 0.0, a NaN
    equals only the same NaN)."""
    flat = tensor.detach().reshape(-1)
    return flat.view(_INT_VIEWS[flat.element_size()])


def encode_delta(old: torch.Tensor, new: torch.Tensor) -> TensorDelta:
    """The delta from `old` to `new` (same dtype, shape and device), compared bitwise: the changed
    elements' positions and values, or the whole `new` when that is not smaller (`delta_form`)."""
    if old.dtype != new.dtype or old.shape != new.shape:
        raise ValueError(f"a delta needs the same dtype and shape: {old.dtype} {list(old.shape)} -> "
                         f"{new.dtype} {list(new.shape)}")
    changed = _bits(old) != _bits(new)
    indices = changed.nonzero().view(-1)
    numel = new.numel()
    form = delta_form(indices.numel(), numel, new.dtype)
    if form == "whole":
        return TensorDelta(None, new)
    return TensorDelta(indices.to(index_dtype(numel)), _bits(new)[indices].view(new.dtype),
                       pack_bits(changed) if form == "bitmask" else None)


@torch.no_grad()
def apply_delta(tensor: torch.Tensor, delta: TensorDelta) -> None:
    """Write `delta` into `tensor` in place (its storage, and views of it, stay what they were)."""
    if delta.values.dtype != tensor.dtype:
        raise ValueError(f"delta values are {delta.values.dtype}, the tensor is {tensor.dtype}")
    if delta.indices is None:
        if delta.values.numel() != tensor.numel():
            raise ValueError(f"a whole-tensor delta of {delta.values.numel()} elements for a tensor of "
                             f"{tensor.numel()}")
        tensor.copy_(delta.values.reshape(tensor.shape))
        return
    if delta.indices.numel() != delta.values.numel():
        raise ValueError(f"a delta of {delta.indices.numel()} indices and {delta.values.numel()} values")
    if not delta.indices.numel():
        return
    index = delta.indices.to(device=tensor.device, dtype=torch.int64)
    # written as integers of the same width: bit for bit, and for every dtype (float8 has no index_copy_)
    ints = tensor.view(_INT_VIEWS[tensor.element_size()])
    values = _bits(delta.values.to(tensor.device))
    if tensor.is_contiguous():
        ints.view(-1).index_copy_(0, index, values)
    else:  # a strided view (no flat view of it exists): address the elements by their coordinates
        ints[torch.unravel_index(index, tensor.shape)] = values


def read_at(tensor: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """The elements of `tensor` at flat `indices` (a copy), as `apply_delta` addresses them."""
    index = indices.to(device=tensor.device, dtype=torch.int64)
    return _bits(tensor)[index].view(tensor.dtype)


# -- sketches ----------------------------------------------------------------------------------------


def _fold(x: torch.Tensor) -> torch.Tensor:
    """A residue of int64 0 <= x < 2^63 mod P = 2^31 - 1, in [0, 2^31] (2^31 = 1 mod P: the high bits
    fold onto the low ones; left one short of fully reduced, which Python's `%` finishes on the sums).
    Two such residues multiply below 2^62."""
    x = (x & SKETCH_PRIME) + (x >> 31)  # < 2^33
    return (x & SKETCH_PRIME) + (x >> 31)


@functools.lru_cache(maxsize=8)
def _power_tables(device: str) -> torch.Tensor:
    """int64 [bases, levels, 2^16]: `T[b, l, i] = r_b ^ (i * 2^(16 l))` mod P (as `_fold` leaves it);
    r^p for p < 2^48 is the product of one entry per level. Built once per device (a pure function of
    it; 3 MB)."""
    tables = torch.empty(len(SKETCH_BASES), _LEVELS, _TABLE_SIZE, dtype=torch.int64)
    for b, base in enumerate(SKETCH_BASES):
        for level in range(_LEVELS):
            step = pow(base, 1 << (_TABLE_BITS * level), SKETCH_PRIME)  # r^(2^(16 l))
            row = tables[b, level]
            row[0] = 1
            n = 1
            while n < _TABLE_SIZE:  # doubling: entries [n, 2n) are entries [0, n) times step^n
                row[n : 2 * n] = _fold(row[:n] * pow(step, n, SKETCH_PRIME))
                n *= 2
    return tables.to(device)


@functools.lru_cache(maxsize=8)
def _row_weights(device: str) -> torch.Tensor:
    """float64 [2^16, 2 * bases]: r_b^j for j < 2^16 split in 16-bit halves (low, high), so that a row of
    2^16 words times it sums exactly in float64 (every partial sum < 2^48)."""
    low = _power_tables(device)[:, 0]
    halves = torch.stack([low & 0xFFFF, low >> 16], dim=-1)  # [bases, 2^16, 2]
    return halves.permute(1, 0, 2).reshape(_TABLE_SIZE, -1).to(torch.float64)


def _word_view(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as flat signed words: 16-bit ones (an element of 4 or 8 bytes is 2 or 4 words,
    low first), 8-bit ones for 1-byte dtypes."""
    flat = tensor.detach().reshape(-1)
    return flat.view(torch.int8 if flat.element_size() == 1 else torch.int16)


def _unsigned(words: torch.Tensor) -> torch.Tensor:
    """`_word_view` words as int64 in [0, 2^bits)."""
    return words.to(torch.int64) & (0xFF if words.element_size() == 1 else 0xFFFF)


def _powers(tables: torch.Tensor, positions: torch.Tensor, num_words: int) -> torch.Tensor:
    """[bases, len(positions)]: r_b ^ p mod P (as `_fold` leaves it) for int64 word positions p of a
    tensor of `num_words` words (the levels its largest position needs)."""
    mask = _TABLE_SIZE - 1
    out = tables[:, 0][:, positions & mask]
    for level in range(1, _LEVELS):
        if num_words <= 1 << (_TABLE_BITS * level):
            break
        out = _fold(out * tables[:, level][:, (positions >> (_TABLE_BITS * level)) & mask])
    return out


def tensor_sketch(tensor: torch.Tensor) -> Sketch:
    """The tensor's sketch (module docstring), computed over all of it on its own device. The words go
    through a float64 matrix product against r^j in 16-bit halves, exact since no sum reaches 2^53."""
    words = _word_view(tensor)
    num_words = words.numel()
    if num_words >= 1 << (_TABLE_BITS * _LEVELS):
        raise ValueError(f"a tensor of {num_words} words is past the sketch's 2^48")
    device = str(words.device)
    tables, weights = _power_tables(device), _row_weights(device)
    sums = [0] * len(SKETCH_BASES)
    for start in range(0, num_words, _BLOCK_WORDS):  # rows of 2^16 words: row c starts at r^(2^16 c)
        x = _unsigned(words[start : start + _BLOCK_WORDS]).to(torch.float64)
        x = torch.nn.functional.pad(x, (0, -x.numel() % _TABLE_SIZE)).view(-1, _TABLE_SIZE)
        halves = (x @ weights).to(torch.int64).T  # [2 * bases, rows], each < 2^16 * 2^16 * 2^16
        row_sums = _fold(halves[0::2] + (_fold(halves[1::2]) << 16))  # [bases, rows]
        first = start >> _TABLE_BITS
        rows = torch.arange(first, first + x.shape[0], device=x.device, dtype=torch.int64) << _TABLE_BITS
        for b, total in enumerate(_fold(row_sums * _powers(tables, rows, num_words)).sum(dim=1).tolist()):
            sums[b] = (sums[b] + total) % SKETCH_PRIME
    return sums[0], sums[1]


def sketch_update(sketch: Sketch, indices: torch.Tensor, old: torch.Tensor, new: torch.Tensor,
                  numel: int) -> Sketch:
    """The sketch of a tensor of `numel` elements once the elements at flat `indices` went from `old` to
    `new` (1-d, the tensor's dtype), from the changed words alone."""
    if not indices.numel():
        return sketch
    old_words, new_words = _unsigned(_word_view(old)), _unsigned(_word_view(new))
    per_element = new_words.numel() // indices.numel()
    positions = indices.to(device=new_words.device, dtype=torch.int64)
    if per_element > 1:  # an element's words are consecutive, low first
        positions = (per_element * positions[:, None] + torch.arange(per_element, device=positions.device))
        positions = positions.view(-1)
    diff = _fold(new_words + (SKETCH_PRIME - old_words))  # (new - old) mod P
    tables = _power_tables(str(diff.device))
    out = list(sketch)
    for start in range(0, diff.numel(), _BLOCK_WORDS):  # each sum stays below 2^52
        part, at = diff[start : start + _BLOCK_WORDS], positions[start : start + _BLOCK_WORDS]
        totals = _fold(part * _powers(tables, at, numel * per_element)).sum(dim=1).tolist()
        out = [(s + t) % SKETCH_PRIME for s, t in zip(out, totals)]
    return out[0], out[1]


# -- an update made of deltas --------------------------------------------------------------------------


def delta_wire_metas(metas: Sequence[TensorMeta], info: DeltaInfo) -> list[TensorMeta]:
    """What the broadcast carries, in order (module docstring); both sides derive it from the update_info."""
    wire = []
    for meta, k, bitmask in zip(metas, info.num_changed, info.bitmask, strict=True):
        if k < 0:
            wire.append(meta)
        elif k > 0:
            wire.append(TensorMeta(f"{meta.name}.bitmask", torch.uint8, (bitmask_nbytes(meta.numel),))
                        if bitmask else TensorMeta(f"{meta.name}.indices", index_dtype(meta.numel), (k,)))
            wire.append(TensorMeta(f"{meta.name}.values", meta.dtype, (k,)))
    return wire


@dataclass(frozen=True)
class DeltaInfo:
    """The `delta` object of an update_info (module docstring)."""

    base_version: str
    num_changed: tuple[int, ...]
    bitmask: tuple[bool, ...]
    sketches: tuple[Sketch, ...]

    def to_json(self) -> dict[str, Any]:
        return {"base_version": self.base_version, "num_changed": list(self.num_changed),
                "bitmask": list(self.bitmask), "sketches": [list(s) for s in self.sketches]}

    @classmethod
    def from_json(cls, body: Any, metas: Sequence[TensorMeta]) -> DeltaInfo:
        """Validate the `delta` object of an update_info describing `metas`; errors are
        `ValueError("Invalid update_info: ...")`."""

        def bad(msg: str) -> ValueError:
            return ValueError(f"Invalid update_info: delta: {msg}")

        keys = ("base_version", "num_changed", "bitmask", "sketches")
        if not isinstance(body, dict) or set(body) != set(keys):
            raise bad(f"expected an object with exactly the keys {list(keys)}")
        base, counts, masks, sketches = (body[k] for k in keys)
        if not isinstance(base, str):
            raise bad(f"'base_version' must be a string, got {base!r}")
        if not all(isinstance(v, list) for v in (counts, masks, sketches)):
            raise bad("'num_changed', 'bitmask' and 'sketches' must be lists")
        if not len(counts) == len(masks) == len(sketches) == len(metas):
            raise bad(f"{len(counts)} num_changed, {len(masks)} bitmask and {len(sketches)} sketches for "
                      f"{len(metas)} tensors")
        for meta, k, mask, s in zip(metas, counts, masks, sketches):
            if isinstance(k, bool) or not isinstance(k, int) or not -1 <= k <= meta.numel:
                raise bad(f"num_changed for {meta.name!r} must be -1 or 0..{meta.numel}, got {k!r}")
            if not isinstance(mask, bool):
                raise bad(f"bitmask for {meta.name!r} must be a boolean, got {mask!r}")
            if not (isinstance(s, list) and len(s) == len(SKETCH_BASES) and all(
                    isinstance(v, int) and not isinstance(v, bool) and 0 <= v < SKETCH_PRIME for v in s)):
                raise bad(f"the sketch of {meta.name!r} must be {len(SKETCH_BASES)} integers in "
                          f"[0, 2^31 - 1), got {s!r}")
        return cls(base, tuple(counts), tuple(masks), tuple((s[0], s[1]) for s in sketches))


@dataclass(frozen=True)
class DeltaUpdate:
    """One delta push: every tensor's meta, its delta (`num_changed` 0: unchanged) and its sketch once
    applied, against the server's weight version `base_version`."""

    metas: tuple[TensorMeta, ...]
    deltas: tuple[TensorDelta, ...]
    sketches: tuple[Sketch, ...]
    base_version: str

    @property
    def info(self) -> DeltaInfo:
        return DeltaInfo(self.base_version, tuple(d.num_changed for d in self.deltas),
                         tuple(d.bitmask is not None for d in self.deltas), self.sketches)

    def update_info(self) -> dict[str, Any]:
        """The body of POST /update_weights (module docstring)."""
        return {"names": [m.name for m in self.metas],
                "dtype_names": [dtype_name(m.dtype) for m in self.metas],
                "shapes": [list(m.shape) for m in self.metas], "delta": self.info.to_json()}

    def wire_metas(self) -> list[TensorMeta]:
        return delta_wire_metas(self.metas, self.info)

    def wire(self) -> list[tuple[str, torch.Tensor]]:
        """The tensors `wire_metas` announces, in order."""
        out = []
        for meta, delta in zip(self.metas, self.deltas):
            if delta.indices is None:
                out.append((meta.name, delta.values))
            elif delta.num_changed:
                part = "bitmask" if delta.bitmask is not None else "indices"
                out += [(f"{meta.name}.{part}", delta.positions), (f"{meta.name}.values", delta.values)]
        return out

    @property
    def nbytes(self) -> int:
        """Bytes the broadcast carries."""
        return sum(d.nbytes for d in self.deltas)

    @property
    def full_nbytes(self) -> int:
        """Bytes of the full push of the same weights."""
        return sum(m.nbytes for m in self.metas)

    @property
    def changed_frac(self) -> float:
        """Changed elements (a whole tensor sent counts whole) over all elements."""
        numel = sum(m.numel for m in self.metas)
        changed = sum(m.numel if d.num_changed < 0 else d.num_changed
                      for m, d in zip(self.metas, self.deltas))
        return changed / numel if numel else 0.0


def split_wire(metas: Sequence[TensorMeta], info: DeltaInfo,
               wire: Iterable[torch.Tensor]) -> Iterator[tuple[TensorMeta, TensorDelta]]:
    """Regroup the received wire tensors (in `delta_wire_metas` order) into `(meta, TensorDelta)` for
    every tensor something was sent for. `wire` is pulled to its end (a receiver finishes its transfer
    there)."""
    it = iter(wire)
    for meta, k, bitmask in zip(metas, info.num_changed, info.bitmask):
        if k < 0:
            yield meta, TensorDelta(None, next(it))
        elif k > 0:
            positions, values = next(it), next(it)
            if not bitmask:
                yield meta, TensorDelta(positions, values)
                continue
            indices = unpack_bits(positions, meta.numel).nonzero().view(-1).to(index_dtype(meta.numel))
            if indices.numel() != k:
                raise ValueError(f"the bitmask of {meta.name!r} marks {indices.numel()} elements, its delta "
                                 f"{k}")
            yield meta, TensorDelta(indices, values, positions)
    leftover = next(it, None)
    assert leftover is None, "the wire holds more tensors than the delta announced"
