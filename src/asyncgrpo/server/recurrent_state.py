"""Per-sequence recurrent state of a hybrid model's Gated DeltaNet layers in the embedded server.

A hybrid (Qwen3.5, Qwen3.5-MoE, Qwen3-Next) keeps the keys and values of its full-attention layers in
the paged KV cache (`kv_cache.py`); each Gated DeltaNet layer keeps instead, per running sequence, a
state of constant size:

    conv window   [W - 1, conv_dim], model dtype   the last W - 1 inputs of its causal convolution
    delta state   [H, K, V], float32               the gated delta rule's S after the last token

Slots are the scheduler's rows: a sequence takes a row when it is admitted, which always goes
through a prefill of its context from token 0 (prompt, plus the output so far after a preemption)
whose first chunk writes the slot completely, and gives the row back when it finishes, is aborted or
preempted. So nothing is carried over in a freed slot and nothing needs clearing. (Prefix caching
never applies to these models: a cached prefix would need the state after it.) One more slot,
`scratch_row`, takes what the padded rows of a CUDA graph's decode step write (`step_graphs.py`).

One server step is the runner's flat row: decode tokens first, one per sequence, then prompt chunks
(chunked prefill: a chunk that does not start at token 0 continues from the slot, as a decode does).
A DeltaNet layer's forward over it (`served_deltanet_forward`, installed by `serve_deltanet_layers`)
uses the layer's own projections, gated norm and output projection and the math that training runs
too (`modeling/deltanet/`):

    convolution   one causal conv over a gathered input in which every decode token and continued
                  chunk is preceded by its sequence's window and every first chunk by W - 1 zeros;
                  the last W - 1 entries of each sequence's part become its new window
    delta rule    decode tokens: one step from the stored state (a chunk of one token); prompt chunks:
                  the chunked rule from the stored state (continued) or zeros (first chunk), each
                  prompt its own root segment of one `ChunkPlan` (no padding to the longest prompt);
                  final states are stored
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import numpy as np
import torch

from asyncgrpo.modeling.deltanet.delta_rule import (
    ChunkPlan,
    chunk_gated_delta_rule,
    normalized_query_key,
    segment_tree_delta_rule,
)
from asyncgrpo.modeling.deltanet.layer import (
    causal_conv1d_at,
    delta_rule_inputs,
    deltanet_layers,
    deltanet_output,
    deltanet_projections,
)
from asyncgrpo.server.host_copy import to_device

__all__ = [
    "STEP_KWARG", "RecurrentState", "RecurrentStep", "serve_deltanet_layers", "served_deltanet_forward",
]

STEP_KWARG = "recurrent_step"  # the model-call keyword that carries a step's RecurrentStep to the layers


class RecurrentState:
    """The conv windows and delta-rule states of every DeltaNet layer, one slot per scheduler row
    (preallocated once, like the KV pools)."""

    def __init__(self, layers: list[torch.nn.Module], num_rows: int, device: torch.device) -> None:
        self.conv: dict[int, torch.Tensor] = {}
        self.delta: dict[int, torch.Tensor] = {}
        self.scratch_row = num_rows
        for layer in layers:
            dtype = layer.conv1d.weight.dtype
            self.conv[layer.layer_idx] = torch.zeros(num_rows + 1, layer.conv_kernel_size - 1, layer.conv_dim,
                                                     dtype=dtype, device=device)
            self.delta[layer.layer_idx] = torch.zeros(num_rows + 1, layer.num_v_heads, layer.head_k_dim,
                                                      layer.head_v_dim,
                                                      dtype=torch.promote_types(dtype, torch.float32),
                                                      device=device)
        self.device = device

    @classmethod
    def for_model(cls, model: torch.nn.Module, num_rows: int, device: torch.device) -> RecurrentState | None:
        """The state of `model`'s DeltaNet layers, or None for a model without any."""
        layers = deltanet_layers(model)
        return cls(layers, num_rows, device) if layers else None

    @staticmethod
    def bytes_per_sequence(model: torch.nn.Module) -> int:
        """Memory of one sequence's slot over every DeltaNet layer of `model`."""
        total = 0
        for layer in deltanet_layers(model):
            item = layer.conv1d.weight.element_size()
            total += (layer.conv_kernel_size - 1) * layer.conv_dim * item
            total += layer.num_v_heads * layer.head_k_dim * layer.head_v_dim * max(item, 4)
        return total

    def step(self, rows: np.ndarray, num_decode: int, prefill_lens: list[int],
             prefill_starts: list[int] | None = None) -> RecurrentStep:
        """The plan of one flat step: `rows` [B] the scheduler rows of its sequences (decode ones
        first), `prefill_lens` the token counts of the prefilled chunks and `prefill_starts` the
        position each starts at (> 0: it continues the sequence's state; None: all start at 0)."""
        starts = [0] * len(prefill_lens) if prefill_starts is None else list(prefill_starts)
        carried = np.array([True] * num_decode + [start > 0 for start in starts], dtype=bool)
        return RecurrentStep(self, to_device(rows, self.device),
                             num_decode, list(prefill_lens), carried)

    def decode_step(self, rows: torch.Tensor) -> RecurrentStep:
        """The plan of a decode step over the rows of a device buffer `rows` [B] (a CUDA graph's static
        input, rewritten before each replay): its index plans depend on B alone, so the layers build
        them at the first call and reuse them, and a replay reads and writes whatever rows it holds."""
        return RecurrentStep(self, rows, len(rows), [], np.ones(len(rows), dtype=bool))


@dataclass(eq=False)
class _ConvPlan:
    """Index plan of one step's convolution for a window of W entries (c = W - 1 of context).

    index: [N] into cat([step inputs (T), carried windows (Bc * c), a zero row]): per sequence, in
        step order, its c context entries (its stored window if carried, else zeros) then its tokens.
    keep: [T] where each step token sits in that gathered input.
    window_index: [B, c] the last c entries of each sequence's part (its next window).
    """

    index: torch.Tensor
    keep: torch.Tensor
    window_index: torch.Tensor


@dataclass(eq=False)
class RecurrentStep:
    """What the DeltaNet layers need for one step (built by `RecurrentState.step`, shared by layers)."""

    state: RecurrentState
    rows: torch.Tensor  # [B] scheduler rows, decode sequences first
    num_decode: int
    prefill_lens: list[int]
    carried: np.ndarray  # [B] bool: the sequence continues from its slot (decode, continued chunk)
    _conv_plans: dict[int, _ConvPlan] = field(default_factory=dict)
    _prefill_plan: ChunkPlan | None = None

    @property
    def num_tokens(self) -> int:
        return self.num_decode + sum(self.prefill_lens)

    def conv_plan(self, width: int) -> _ConvPlan:
        if width not in self._conv_plans:
            self._conv_plans[width] = self._build_conv_plan(width)
        return self._conv_plans[width]

    def _build_conv_plan(self, width: int) -> _ConvPlan:
        c, nd, total = width - 1, self.num_decode, self.num_tokens
        carried_slot = np.cumsum(self.carried) - 1  # each carried sequence's place among the windows
        zero = total + int(self.carried.sum()) * c
        lens = np.array([1] * nd + self.prefill_lens, dtype=np.int64)
        starts = np.concatenate([[0], np.cumsum(lens)[:-1]])  # first token of each sequence in the step
        sections = lens + c
        ends = np.cumsum(sections)  # end of each sequence's part in the gathered input
        index = np.empty(int(ends[-1]), dtype=np.int64)
        keep = np.empty(total, dtype=np.int64)
        for s, (start, n, end) in enumerate(zip(starts, lens, ends)):
            base = end - n - c
            index[base : base + c] = total + carried_slot[s] * c + np.arange(c) if self.carried[s] else zero
            index[base + c : end] = start + np.arange(n)
            keep[start : start + n] = base + c + np.arange(n)
        window = ends[:, None] - c + np.arange(c)[None, :]
        to = functools.partial(_to_device, device=self.rows.device)
        return _ConvPlan(to(index), to(keep), to(window))

    def carried_rows(self) -> torch.Tensor:
        """The scheduler rows whose stored window and state this step continues from."""
        if self.carried.all():
            return self.rows
        return self.rows[_to_device(np.flatnonzero(self.carried), self.rows.device)]

    def continued_chunks(self) -> torch.Tensor:
        """[Bp] bool: the prompt chunk continues its sequence's state (else: a first chunk, from zeros)."""
        return torch.from_numpy(np.ascontiguousarray(self.carried[self.num_decode:])).to(self.rows.device)

    def prefill_plan(self) -> ChunkPlan:
        """The prompt chunks (the step's tokens after the decode ones) as root segments of a chunk plan."""
        if self._prefill_plan is None:
            lens = np.array(self.prefill_lens, dtype=np.int64)
            starts = np.concatenate([[0], np.cumsum(lens)[:-1]])
            self._prefill_plan = ChunkPlan.build(np.full(lens.size, -1), starts, lens,
                                                 device=self.rows.device)
        return self._prefill_plan


def _to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    return to_device(np.ascontiguousarray(array, dtype=np.int64), device)


def served_deltanet_forward(
    layer: torch.nn.Module, hidden_states: torch.Tensor, step: RecurrentStep
) -> torch.Tensor:
    """The layer's forward over one flat step, hidden_states [1, T, hidden] -> [1, T, hidden], reading
    and updating the running sequences' slots of `step.state`."""
    num_tokens = hidden_states.shape[1]
    if hidden_states.shape[0] != 1 or num_tokens != step.num_tokens:
        raise ValueError(f"the server step has {step.num_tokens} tokens, the layer got hidden states of "
                         f"shape {tuple(hidden_states.shape[:2])}")
    state, idx, nd = step.state, layer.layer_idx, step.num_decode
    mixed, z, b, a = deltanet_projections(layer, hidden_states[0])
    plan = step.conv_plan(layer.conv_kernel_size)
    windows = state.conv[idx]
    channels = mixed.shape[1]
    carried = step.carried_rows()
    source = torch.cat([mixed, windows[carried].reshape(-1, channels).to(mixed.dtype),
                        mixed.new_zeros(1, channels)])
    gathered = source[plan.index]
    windows[step.rows] = gathered[plan.window_index].to(windows.dtype)
    mixed = causal_conv1d_at(gathered, plan.keep, layer.conv1d.weight[:, 0], layer.conv1d.bias,
                             layer.activation)

    query, key, value, g, beta = delta_rule_inputs(layer, mixed, b, a)
    query, key = normalized_query_key(query, key, value.shape[-2])
    states = state.delta[idx]
    parts = []
    if nd:
        rows = step.rows[:nd]
        out, final = chunk_gated_delta_rule(query[:nd, None], key[:nd, None], value[:nd, None], g[:nd, None],
                                            beta[:nd, None], states[rows], chunk_size=1)
        states[rows] = final.to(states.dtype)
        parts.append(out[:, 0])
    if step.prefill_lens:
        prefill_rows = step.rows[nd:]
        initial = torch.where(step.continued_chunks()[:, None, None, None], states[prefill_rows], 0.0)
        out, final = segment_tree_delta_rule(query[nd:], key[nd:], value[nd:], g[nd:], beta[nd:],
                                             step.prefill_plan(), initial, output_final_state=True)
        states[prefill_rows] = final.to(states.dtype)
        parts.append(out)
    core = (parts[0] if len(parts) == 1 else torch.cat(parts)).to(value.dtype)
    return deltanet_output(layer, core, z)[None]


def serve_deltanet_layers(model: torch.nn.Module, expected: int) -> int:
    """Give every Gated DeltaNet layer of `model` its server-step forward; `expected` is the number
    of `linear_attention` layers the config declares (a mismatch means a layer class the server does
    not run: refused). Returns the number of layers."""
    layers = deltanet_layers(model)
    if len(layers) != expected:
        raise ValueError(f"the config declares {expected} linear-attention layers but {len(layers)} are "
                         "Gated DeltaNet layers the embedded server runs (those of Qwen3.5, Qwen3.5-MoE and "
                         "Qwen3-Next); serve this model with vLLM")
    for layer in layers:
        if not (hasattr(layer, "in_proj_qkvz") or hasattr(layer, "in_proj_qkv")):
            raise ValueError(f"{type(layer).__name__} has neither in_proj_qkv (Qwen3.5) nor in_proj_qkvz "
                             "(Qwen3-Next) projections; this transformers version lays the layer out "
                             "differently from the one the embedded server was verified with "
                             "(transformers >= 5.15)")
        layer.forward = functools.partial(_forward, layer, layer.forward)
    return len(layers)


def _forward(
    layer: torch.nn.Module, own_forward, hidden_states: torch.Tensor, *args, **kwargs
) -> torch.Tensor:
    """A server step's forward when the model call carries a RecurrentStep; else the layer's own
    (a plain forward of the served model: the load-time self-check's reference)."""
    step = kwargs.pop(STEP_KWARG, None)
    if step is None:
        return own_forward(hidden_states, *args, **kwargs)
    return served_deltanet_forward(layer, hidden_states, step)
