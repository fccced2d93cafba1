"""LoRA adapters in the embedded server (`--enable-lora`): slots of stacked weights, the batched delta,
and which adapter holds which slot.

Every LoRA target (an `nn.Linear` of the served model's decoder) gets stacked weights with one block of
`max_lora_rank` rows per slot (`--max-loras` slots):

    A [S * R, in]     rows s*R .. s*R + r: slot s's lora_A (rank r <= R), the rest zero
    B [S * R, out]    the same rows: slot s's (scaling * lora_B).T

A step's tokens each carry a slot (-1: the base model). With the one-hot mask M [N, S * R] (token n's
slot block set to 1), the target's output gains, for every token of the step at once,

    delta = ((x @ A.T) * M) @ B

two matmuls per target whatever mix of adapters the batch holds (never one forward per adapter), the
second one adding into the target's output (`addmm`); a step that uses no adapter skips them, and the
matmuls only span the slots between the lowest and the highest one in use (in a CUDA graph's step,
whose shapes are fixed, they span every slot and M is expanded from a static one-hot buffer:
`fixed_step`). Zero rows and zero mask entries add exact zeros, so a token's delta is its own
adapter's. Where `fuse_layers` joined projections (q/k/v, gate/up) into one matmul, `JoinedDelta`
adds their deltas to the joined output with the same three kernels: the parts' A stacked into one
matrix and their B into one block-diagonal matrix (each part's stack is a view into them), instead
of three kernels per part and a concatenation. A decode step of a Qwen3 layer thus runs 12 LoRA
kernels instead of 27. Other targets get a wrapped forward.

The slot bookkeeping (`AdapterRegistry`) lives in the event loop: a request takes a reference on its
adapter for as long as it runs, and an unloaded adapter's slot is reused only once its last request
ended, so a load never overwrites weights under a running sequence. Slot weights are written by the
engine thread (`ServedLora.write`, through `Engine.call`), between two forward passes. Each load gets
a fresh `hash_root` for the prefix cache: blocks computed under one adapter (or an earlier load under
the same name) are never found by another.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import itertools
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch

from asyncgrpo.server.host_copy import to_device
from asyncgrpo.server.lora_files import AdapterWeights
from asyncgrpo.server.prefix_cache import ROOT_HASH


@dataclass
class _Stack:
    a: torch.Tensor  # [S * R, in]
    b: torch.Tensor  # [S * R, out]


class ServedLora:
    """The stacked adapter weights of every LoRA target and the current step's token slots."""

    def __init__(self, model: torch.nn.Module, max_loras: int, max_rank: int) -> None:
        self.max_loras = max_loras
        self.max_rank = max_rank
        self.stacks: dict[str, _Stack] = {}
        self._cols: slice | None = None  # the columns of the slots in use this step (None: no adapter)
        self._mask: torch.Tensor | None = None  # [N, cols] one-hot of each token's slot
        decoder = {id(m) for m in model.get_decoder().modules()}
        output = model.get_output_embeddings()
        linears = {
            name: m for name, m in model.named_modules()
            if isinstance(m, torch.nn.Linear) and id(m) in decoder and m is not output
        }
        rows = max_loras * max_rank
        for name, lin in linears.items():
            w = lin.weight
            self.stacks[name] = _Stack(
                torch.zeros(rows, lin.in_features, dtype=w.dtype, device=w.device),
                torch.zeros(rows, lin.out_features, dtype=w.dtype, device=w.device),
            )
        self._part_masks: dict[int, torch.Tensor] = {}  # the step's M repeated for P joined parts
        joined: set[str] = set()
        for name, module in model.named_modules():
            parts = module.__dict__.get("joined_projections")  # set by fused_layers.fuse_layers
            if parts and all(f"{name}.{p}" in self.stacks for p in parts):
                module.joined_lora = JoinedDelta(self, [f"{name}.{p}" for p in parts])
                joined.update(f"{name}.{p}" for p in parts)
        for name, lin in linears.items():
            if name not in joined:  # a joined projection's own forward never runs
                lin.forward = functools.partial(_linear_forward, lin.forward, self, self.stacks[name])

    def targets(self) -> dict[str, tuple[int, int]]:
        """Module path -> (in_features, out_features) of every target an adapter may have."""
        return {name: (s.a.shape[1], s.b.shape[1]) for name, s in self.stacks.items()}

    @torch.no_grad()
    def write(self, slot: int, weights: AdapterWeights) -> None:
        """Engine thread: make `slot` hold `weights` (targets it lacks get zeros)."""
        r_max = self.max_rank
        block = slice(slot * r_max, (slot + 1) * r_max)
        for name, stack in self.stacks.items():
            stack.a[block].zero_()
            stack.b[block].zero_()
            if name in weights.modules:
                a, b = weights.modules[name]
                r = a.shape[0]
                stack.a[slot * r_max : slot * r_max + r].copy_(a)
                stack.b[slot * r_max : slot * r_max + r].copy_(b.T)

    @contextlib.contextmanager
    def step(self, token_slots: np.ndarray) -> Iterator[None]:
        """Around one forward pass: token i of the flat step uses slot token_slots[i] (-1: none)."""
        used = token_slots[token_slots >= 0]
        if used.size:
            lo, hi = int(used.min()), int(used.max())
            some = next(iter(self.stacks.values())).a
            onehot = to_device(self.slot_onehot(token_slots, lo, hi - lo + 1), some.device)
            self._mask = onehot.to(some.dtype).repeat_interleave(self.max_rank, 1)
            self._cols = slice(lo * self.max_rank, (hi + 1) * self.max_rank)
        try:
            yield
        finally:
            self._mask = self._cols = None
            self._part_masks.clear()

    def slot_onehot(self, token_slots: np.ndarray, first: int = 0,
                    num_slots: int | None = None) -> np.ndarray:
        """[N, num_slots] float32: row n one-hot of token n's slot (slots counted from `first`; -1: a
        zero row); repeated over each slot's rank rows it is the M of the module docstring."""
        num_slots = self.max_loras - first if num_slots is None else num_slots
        onehot = np.zeros((len(token_slots), num_slots), dtype=np.float32)
        rows = np.flatnonzero(token_slots >= 0)
        onehot[rows, token_slots[rows] - first] = 1.0
        return onehot

    @contextlib.contextmanager
    def fixed_step(self, onehot: torch.Tensor) -> Iterator[None]:
        """Around a forward pass of fixed shapes (a CUDA graph's, `step_graphs.py`): every slot's
        columns, `onehot` [N, S] a buffer rewritten with `slot_onehot` before each replay."""
        self._mask = onehot.repeat_interleave(self.max_rank, 1)
        self._cols = slice(0, self.max_loras * self.max_rank)
        try:
            yield
        finally:
            self._mask = self._cols = None
            self._part_masks.clear()

    @property
    def dtype(self) -> torch.dtype:
        return next(iter(self.stacks.values())).a.dtype

    def mask(self, parts: int = 1) -> torch.Tensor:
        """The step's M [N, cols], side by side `parts` times for a joined target (made once per step:
        every layer's joined q/k/v reads the same one)."""
        if parts == 1:
            return self._mask
        if parts not in self._part_masks:
            self._part_masks[parts] = self._mask.repeat(1, parts)
        return self._part_masks[parts]

    def add_delta(self, out: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                  parts: int = 1) -> torch.Tensor:
        """out + ((x @ a.T) * M) @ b for input x [..., N, in] and output out [..., N, out]: the
        target's output with its adapters' contribution, in three kernels."""
        flat = x.reshape(-1, x.shape[-1])
        mask = self.mask(parts)
        assert flat.shape[0] == mask.shape[0], "a LoRA target saw another token count than the step's"
        xa = (flat @ a.T) * mask
        return torch.addmm(out.reshape(-1, out.shape[-1]), xa, b).view(out.shape)


def _linear_forward(forward, lora: ServedLora, stack: _Stack, x: torch.Tensor) -> torch.Tensor:
    out = forward(x)
    cols = lora._cols
    if cols is None:  # no adapter in this step, or a forward pass outside the server's steps
        return out
    return lora.add_delta(out, x, stack.a[cols], stack.b[cols])


class JoinedDelta:
    """The adapters' contribution to a fused forward's joined output (its projections side by side).

    Owns the stacked weights of its P parts: A [P * S * R, in] (part p's rows at p * S * R) and the
    block-diagonal B [P * S * R, sum of the parts' outputs] (part p's block at its rows and at its
    output's columns, zeros elsewhere); the parts' `_Stack`s in `lora.stacks` become views into them,
    so that `ServedLora.write` fills them as before."""

    def __init__(self, lora: ServedLora, names: list[str]) -> None:
        self.lora = lora
        parts = [lora.stacks[n] for n in names]
        self.rows = parts[0].a.shape[0]  # S * R
        self.outs = [s.b.shape[1] for s in parts]
        self.a = torch.cat([s.a for s in parts])
        self.b = parts[0].b.new_zeros(len(parts) * self.rows, sum(self.outs))
        col = 0
        for p, (name, out) in enumerate(zip(names, self.outs)):
            rows = slice(p * self.rows, (p + 1) * self.rows)
            lora.stacks[name] = _Stack(self.a[rows], self.b[rows, col : col + out])
            col += out

    def __call__(self, x: torch.Tensor, joined: torch.Tensor) -> torch.Tensor:
        cols = self.lora._cols
        if cols is None:
            return joined
        a, b = self.a, self.b
        # the slots in use, in every part's block (a gather: eager steps only)
        if cols != slice(0, self.rows):
            n = len(self.outs)
            a = a.view(n, self.rows, -1)[:, cols].reshape(-1, a.shape[1])
            b = b.view(n, self.rows, -1)[:, cols].reshape(-1, b.shape[1])
        return self.lora.add_delta(joined, x, a, b, parts=len(self.outs))


@dataclass(eq=False)
class Adapter:
    """A loaded adapter: its name, where it was read from and the slot holding its weights."""

    name: str
    path: str
    slot: int
    rank: int
    hash_root: bytes  # root of its sequences' prefix-cache block hashes (unique per load)
    users: int = 0  # requests running with it
    unloaded: bool = False  # gone from the name table; its slot frees when `users` drops to 0


class AdapterRegistry:
    """Names -> adapters and slot ownership (event-loop side; see the module docstring)."""

    def __init__(self, max_loras: int) -> None:
        self.by_name: dict[str, Adapter] = {}
        self.slots: list[Adapter | str | None] = [None] * max_loras  # str: reserved by a load in progress
        self._load_ids = itertools.count(1)

    def reserve(self, name: str) -> int | None:
        """A free slot for a load of `name` (marked reserved), else None. A reload under a loaded name
        needs a free slot too: the old weights keep serving until the new ones are in."""
        free = [i for i, holder in enumerate(self.slots) if holder is None]
        if not free:
            return None
        self.slots[free[0]] = name
        return free[0]

    def release(self, slot: int) -> None:
        """A reserved slot whose load failed."""
        assert isinstance(self.slots[slot], str)
        self.slots[slot] = None

    def add(self, name: str, path: str, slot: int, rank: int) -> Adapter:
        """Register the adapter just written to the reserved `slot` (replacing one of the same name)."""
        old = self.by_name.get(name)
        if old is not None:
            self._drop(old)
        load_id = next(self._load_ids)
        root = hashlib.blake2b(ROOT_HASH + f"\0lora\0{name}\0{load_id}".encode(), digest_size=16).digest()
        adapter = Adapter(name, path, slot, rank, root)
        self.slots[slot] = adapter
        self.by_name[name] = adapter
        return adapter

    def remove(self, name: str) -> None:
        self._drop(self.by_name[name])

    def _drop(self, adapter: Adapter) -> None:
        del self.by_name[adapter.name]
        adapter.unloaded = True
        if adapter.users == 0:
            self.slots[adapter.slot] = None

    def holders(self) -> list[str]:
        """What holds each slot, for error messages."""
        out = []
        for holder in self.slots:
            if isinstance(holder, Adapter):
                out.append(holder.name + (f" (unloaded, {holder.users} requests still running)"
                                          if holder.unloaded else ""))
            elif isinstance(holder, str):
                out.append(f"{holder} (loading)")
        return out

    @contextlib.contextmanager
    def using(self, adapter: Adapter | None) -> Iterator[None]:
        """Hold `adapter`'s slot for the duration of a request."""
        if adapter is None:
            yield
            return
        adapter.users += 1
        try:
            yield
        finally:
            adapter.users -= 1
            if adapter.unloaded and adapter.users == 0:
                self.slots[adapter.slot] = None
