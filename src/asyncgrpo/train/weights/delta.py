"""The trainer's side of delta pushes (`weight_push="delta"`): `LastPush`, the copy of the weights the
server holds, which a delta is taken against. The collective transport (collective.py) keeps one:

    a push   LastPush.advance(tensors)      before pausing: the copy takes the new weights in place and
                                            returns the delta from what it held (None: no base yet)
             paused:  /weight_info == the copy's label and the delta is smaller -> WeightSender.push_delta
                      otherwise, or the server refuses the delta (412)          -> a full push of the copy
             landed:  LastPush.label = the version          failed: forget() (the next push is full)

The copy holds every served weight once, in the serving dtype, on the device the pushes are sent from
(the trainer's GPU, or host memory on a CPU trainer): 2 bytes a parameter in bf16 (269 MB for
SmolLM2-135M, 16 GB for an 8B model). Encoding a tensor adds, for that tensor only, a mask of its
changed elements (1 byte each) and their indices (8 bytes each). The sketches (`asyncgrpo.sync.delta`)
cost one pass over the copy after a full push, then only the changed words.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence

import torch

from asyncgrpo.sync.delta import (
    DeltaUpdate,
    Sketch,
    TensorDelta,
    apply_delta,
    encode_delta,
    read_at,
    sketch_update,
    tensor_sketch,
)
from asyncgrpo.sync.packed import TensorMeta, check_tensor


class LastPush:
    """The weights of the trainer's last push, as the server holds them under `label` (None: the server's
    weights are not known to be these: the next push is full)."""

    def __init__(self, device: torch.device) -> None:
        self.device = torch.device(device)
        self.tensors: dict[str, torch.Tensor] = {}
        self.label: str | None = None
        self._sketches: dict[str, Sketch] = {}

    def forget(self) -> None:
        """The server may hold other weights (a failed push, a new transfer group): the next push is full."""
        self.label = None

    def named_tensors(self, metas: Sequence[TensorMeta]) -> Iterator[tuple[str, torch.Tensor]]:
        """The copy, in `metas` order (what a full push sends)."""
        for meta in metas:
            yield meta.name, self.tensors[meta.name]

    def advance(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], metas: Sequence[TensorMeta]
    ) -> DeltaUpdate | None:
        """Make the copy `named_tensors` (exactly `metas`, pulled once) and return the delta from what it
        held, against the server's version `label`; None when there is no base (no label, or other
        tensors): the copy is then made anew. Until the push lands, `label` is None."""
        metas = list(metas)
        base, self.label = self.label, None
        held = [(name, t.dtype, tuple(t.shape)) for name, t in self.tensors.items()]
        if base is None or held != [(m.name, m.dtype, m.shape) for m in metas]:
            self.tensors, self._sketches = {}, {}  # the old copy goes first: never two at once
            for meta, (name, tensor) in _checked(metas, named_tensors):
                self.tensors[name] = tensor.detach().to(self.device, copy=True)
            return None
        deltas, sketches = [], []
        for meta, (name, tensor) in _checked(metas, named_tensors):
            copy = self.tensors[name]
            delta = encode_delta(copy, tensor.detach().to(self.device))
            if delta.indices is None:
                copy.copy_(delta.values)
                delta, sketch = TensorDelta(None, copy), tensor_sketch(copy)  # sent from the copy
            elif delta.num_changed:
                before, old = self.sketch(name), read_at(copy, delta.indices)
                apply_delta(copy, delta)
                sketch = sketch_update(before, delta.indices, old, delta.values, copy.numel())
            else:
                sketch = self.sketch(name)
            self._sketches[name] = sketch
            deltas.append(delta)
            sketches.append(sketch)
        return DeltaUpdate(tuple(metas), tuple(deltas), tuple(sketches), base)

    def sketch(self, name: str) -> Sketch:
        """The copy's sketch of `name` (over the whole tensor the first time after a full push)."""
        if name not in self._sketches:
            self._sketches[name] = tensor_sketch(self.tensors[name])
        return self._sketches[name]


def _checked(
    metas: Sequence[TensorMeta], named_tensors: Iterable[tuple[str, torch.Tensor]]
) -> Iterator[tuple[TensorMeta, tuple[str, torch.Tensor]]]:
    """Each meta with its tensor, checked against it; the iterator must yield exactly `metas`."""
    it = iter(named_tensors)
    for meta in metas:
        pair = next(it, None)
        if pair is None:
            raise ValueError(f"weight update: the tensor iterator ended before {meta.name!r}")
        check_tensor(meta, *pair)
        yield meta, pair
    if next(it, None) is not None:
        raise ValueError(
            f"weight update: the tensor iterator yields more than the {len(metas)} announced tensors")
