"""Steps with fixed shapes, replayed as CUDA graphs: the forward pass, then sampling.

A decode step of B sequences is padded to a batch bucket (1, 2, 4, 8, 16, 32, then steps of 32 up to
256 and of 128 above), its block tables to a power-of-two number of blocks and its groups of rows
sharing their first blocks (`attention/shared_prefix.py`) to a power-of-two number of group entries (0:
none); every input lives in a static device buffer, so each bucket is captured once and replayed: the
~30 kernels per layer of the Hugging Face forward cost one launch. The execution plan keys the graphs
(`ExecutionPlan.graph_key`): where its decode attention never splits a context from some batch bucket
on (the Triton kernel, about 2 x multiprocessors / kv heads rows), such steps take the whole table, one
graph for every context length; without the shared pass no graph has group entries. Padded rows read
and write the cache's scratch block and their logits are dropped; padded group entries have no members.

A row is one query of the paged decode attention: a token, its position, the cache slot its keys go
to, its sequence's blocks and how many of them it sees. A decode sequence is one row; so is each
token of a short prompt chunk (`step_rows.prompt_rows`, up to `max_prompt_rows` of them per step), whose
rows see the chunk's earlier tokens because every layer writes the step's keys before it attends. So
a step that carries a conversation's next turn or a group member's last prompt block replays a graph
too, instead of launching an eager forward of ~1,000 kernels. The LM head runs on the rows that
sample only (`sample_rows`, padded to the decode batch bucket).

Sampling (~100 small kernels, which at small batches take longer to launch than to run) is a second
graph per (batch bucket, sampling plan): the plan is the host-side shape of `sampling.sample`
(sorted columns, top-K count, mask width, whether every row has top_k), usually one per workload.
It reads the logits and the per-row parameters from static buffers and writes the step's packed
output (`sampling.pack`). Steps whose logits need processing first (repetition penalty, min_tokens
bans) sample eagerly.

Without CUDA (or with graphs off) the same static path runs eagerly, which is how the CPU tests
check it. The graphs read the plan they were built with; the runner that replays them holds the same.
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import TYPE_CHECKING

import numpy as np
import torch

from asyncgrpo.capture_gate import capture_window
from asyncgrpo.server.attention.base import DecodeSegment, SharedPrefixTensors, StepAttention
from asyncgrpo.server.attention.plan import ExecutionPlan, GraphKey
from asyncgrpo.server.host_copy import copy_into
from asyncgrpo.server.kv_cache import PagedKVCache
from asyncgrpo.server.recurrent_state import STEP_KWARG, RecurrentState, RecurrentStep
from asyncgrpo.server.sampling import SamplingPlan, pack, sample

# a CUDA stream priority past the device's range maps to the nearest one it has (lower is higher)
HIGHEST_PRIORITY = -(1 << 10)

if TYPE_CHECKING:
    from asyncgrpo.server.lora import ServedLora
    from asyncgrpo.server.step_rows import StepRows

logger = logging.getLogger(__name__)


# prompt tokens a step may add to its decode rows and still replay a graph (about four turns of a
# conversation, or 64 group members' last prompt blocks); longer steps run eagerly
MAX_PROMPT_ROWS = 1024
# graphs kept at most (each holds ~1,000 kernel nodes in host memory; the device memory is one pool):
# steps of shapes met after that run the same static path eagerly
MAX_GRAPHS = 256


def batch_bucket(n: int) -> int:
    for b in (1, 2, 4, 8, 16, 32):
        if n <= b:
            return b
    if n <= 256:
        return -(-n // 32) * 32
    return -(-n // 128) * 128  # steps with prompt rows: fewer graphs, the padding costs little there


def block_bucket(n: int, max_blocks: int) -> int:
    b = 1
    while b < n:
        b *= 2
    return min(b, max_blocks)


class StepGraphs:
    """Static buffers + captured graphs for steps of rows (engine thread only)."""

    def __init__(
        self,
        model: torch.nn.Module,
        cache: PagedKVCache,
        plan: ExecutionPlan,
        max_num_seqs: int,
        max_blocks: int,
        use_graphs: bool,
        vocab_size: int,
        max_prompt_rows: int = MAX_PROMPT_ROWS,
        lora: ServedLora | None = None,
        recurrent: RecurrentState | None = None,
    ) -> None:
        """plan: the execution plan (device, decode attention backends, graph keys). max_prompt_rows: prompt
        tokens a step may add to its decode rows and still take a graph (where the plan lays chunks out as
        rows; 0: decode-only steps). lora: the served LoRA adapters (`--enable-lora`): steps with adapter
        rows replay graphs that add every slot's delta, each row's slot a one-hot in a static buffer.
        recurrent: a hybrid model's DeltaNet state (`recurrent_state.py`): decode steps read and write the
        slots of the scheduler rows held in a static buffer (padded rows: its scratch slot); steps with
        prompt tokens run eagerly."""
        self.model = model
        self.cache = cache
        self.plan = plan
        self.device = device = plan.device
        self.max_blocks = max_blocks
        # (every decode backend of the plan declares that a graph may capture it)
        self.use_graphs = use_graphs and plan.graphs_capture
        self.max_prompt_rows = max_prompt_rows
        self._num_sampled = batch_bucket(max_num_seqs)  # rows that sample: at most one per sequence
        n = batch_bucket(max_num_seqs + max_prompt_rows)
        # rows: input ids, positions, cache slots, context lengths, rows the LM head keeps (sampled first)
        self._vec = torch.zeros(5, n, dtype=torch.int64, device=device)
        self._tables = torch.zeros(n, max_blocks, dtype=torch.int64, device=device)
        # groups sharing their first blocks (shared_prefix.py): tokens each sequence's group reads, and
        # the group entries (shared tokens, members), allocated at the first step that has groups
        self._shared_lens = torch.zeros(n, dtype=torch.int64, device=device)
        self.lora = lora
        self.recurrent = recurrent
        if recurrent is not None:  # each row's slot of the DeltaNet state, and each batch bucket's plan
            self._state_rows = torch.full((n,), recurrent.scratch_row, dtype=torch.int64, device=device)
            self._recurrent_steps: dict[int, RecurrentStep] = {}
        if lora is not None:  # each row's adapter slot, one-hot (zero rows: the base model)
            self._slots = torch.zeros(n, lora.max_loras, dtype=lora.dtype, device=device)
        self._groups: torch.Tensor | None = None
        self._graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._full = False  # MAX_GRAPHS reached (and said so)
        self.num_captures = 0  # graphs captured so far and the seconds it took (/server_info reports them: a
        self.capture_s = 0.0  # capture mid-run stalls the step that meets a new shape)
        # steps of a new shape run eagerly while a trainer in this process computed
        self.captures_deferred = 0
        self._pools: dict[str, object] = {}  # one memory pool per kind of graph (forward, sample)
        self._capture_stream: torch.cuda.Stream | None = None  # warm-ups and captures (see _capture)
        self._scratch_slot = cache.scratch_block * cache.block_size
        # sampling inputs: float32 logits, then rows (temperature, top_p, min_p) and (top_k, row hash)
        ns = self._num_sampled
        self._logits = torch.zeros(ns, vocab_size, dtype=torch.float32, device=device)
        self._floats = torch.zeros(3, ns, dtype=torch.float32, device=device)
        self._ints = torch.zeros(2, ns, dtype=torch.int64, device=device)

    def run(self, inputs: StepRows, pending: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """One step of B rows (`pending`: rows whose token is on the device, and those tokens). Returns the
        logits of the rows that sample ([S, V]: every row of a decode step, `inputs.sample_rows` of one
        with prompt rows)."""
        b, nb = inputs.block_tables.shape
        bp = batch_bucket(b)
        width = block_bucket(nb, self.max_blocks)  # the columns written; those past them are never read
        # padded rows: token 0 at position 0, written to and read from the scratch block
        host = np.empty((5, bp), dtype=np.int64)
        host[:4, b:] = np.array([[0], [0], [self._scratch_slot], [1]])
        host[:4, :b] = (inputs.token_ids, inputs.positions, inputs.slots, inputs.context_lens)
        host[4] = np.arange(bp)
        num_sampled = b
        if inputs.sample_rows is not None:
            num_sampled = len(inputs.sample_rows)
            assert num_sampled <= self._num_sampled, "at most one sampled row per sequence"
            host[4, :num_sampled] = inputs.sample_rows
        table = np.full((bp, width), self.cache.scratch_block, dtype=np.int64)
        table[:b, :nb] = inputs.block_tables
        copy_into(self._vec[:, :bp], host)
        if pending is not None:
            self._vec[0].index_copy_(0, *pending)
        copy_into(self._tables[:bp, :width], table)
        gp = 0  # group entries of the graph: a bucket of the step's, 0 without shared blocks
        if inputs.shared is not None:
            g, width = inputs.shared.groups.shape
            if self._groups is None:  # at most one entry per two sequences
                self._groups = torch.zeros(max(len(self._shared_lens) // 2, 1), width, dtype=torch.int64,
                                           device=self.device)
            assert self._groups.shape[1] == width, "group entries keep their width (members per entry)"
            gp = block_bucket(g, self._groups.shape[0])  # powers of two: few graphs as groups finish
            lens = np.zeros(bp, dtype=np.int64)
            lens[:b] = inputs.shared.lens
            groups = np.full((gp, self._groups.shape[1]), -1, dtype=np.int64)
            groups[:, 0] = 0
            groups[:g] = inputs.shared.groups
            copy_into(self._shared_lens[:bp], lens)
            copy_into(self._groups[:gp], groups)
        if self.recurrent is not None:
            rows = np.full(bp, self.recurrent.scratch_row, dtype=np.int64)
            rows[:b] = inputs.seq_rows
            copy_into(self._state_rows[:bp], rows)
        adapters = inputs.lora_slots is not None and bool((inputs.lora_slots >= 0).any())
        if adapters:  # graphs without adapter rows skip the LoRA matmuls
            slots = np.full(bp, -1, dtype=np.int64)
            slots[:b] = inputs.lora_slots
            copy_into(self._slots[:bp], self.lora.slot_onehot(slots))
        key = self.plan.graph_key(bp, width, gp, adapters, self.max_blocks)
        return self._replay(("forward", *key), lambda: self._forward(key))[:num_sampled]

    def sample(self, logits: torch.Tensor, plan: SamplingPlan, token_hashes: torch.Tensor) -> torch.Tensor:
        """Sample B rows of logits ([B, V], any float dtype) with the host parameters of `plan`
        (`token_hashes`: the runner's `sampling.token_hash` of every id, a buffer that outlives the
        graphs). Returns the packed step output [B, columns] (`sampling.pack`)."""
        b = logits.shape[0]
        bp = batch_bucket(b)
        self._logits[:b].copy_(logits)
        # padded rows: temperature 1, no top_k / top_p / min_p; their logits are stale but finite
        floats = np.empty((3, bp), dtype=np.float32)
        floats[:, b:] = np.array([[1.0], [1.0], [0.0]], dtype=np.float32)
        floats[:, :b] = plan.floats
        ints = np.zeros((2, bp), dtype=np.int64)
        ints[:, :b] = plan.ints
        copy_into(self._floats[:, :bp], floats)
        copy_into(self._ints[:, :bp], ints)
        key = ("sample", bp, plan.num_sorted, plan.num_top_logprobs, plan.mask_width, plan.all_top_k)
        return self._replay(key, lambda: self._sample(bp, plan, token_hashes))[:b]

    def _sample(self, bp: int, plan: SamplingPlan, token_hashes: torch.Tensor) -> torch.Tensor:
        batch = plan.batch(self._floats[:, :bp], self._ints[:, :bp], token_hashes)
        return pack(sample(self._logits[:bp], batch))

    def _replay(self, key: tuple, fn) -> torch.Tensor:
        """fn() through its captured graph (captured on first use), or eagerly with graphs off."""
        if not self.use_graphs:
            return fn()
        if key not in self._graphs:
            if len(self._graphs) >= MAX_GRAPHS:
                if not self._full:
                    logger.info("%d CUDA graphs captured; steps of shapes not met yet run eagerly",
                                MAX_GRAPHS)
                    self._full = True
                return fn()
            with capture_window() as free:
                if not free:  # a trainer in this process computes (capture_gate.py): capture at a later step
                    self.captures_deferred += 1
                    return fn()
                if not self._captured(key, fn):
                    self.use_graphs = False
                    return fn()
        graph, out = self._graphs[key]
        graph.replay()
        return out

    def _forward(self, key: GraphKey) -> torch.Tensor:
        """The step of `key`'s shape over the static buffers: one segment of decode rows."""
        bp, gp = key.rows, key.groups
        shared = SharedPrefixTensors(self._shared_lens[:bp], self._groups[:gp]) if gp else None
        rows = DecodeSegment(bp, self._tables[:bp, : key.blocks], self._vec[3, :bp], shared)
        meta = StepAttention(self.cache, self._vec[2, :bp], [rows], self.plan.backends)
        extra = {}
        if self.recurrent is not None:
            if bp not in self._recurrent_steps:
                self._recurrent_steps[bp] = self.recurrent.decode_step(self._state_rows[:bp])
            extra[STEP_KWARG] = self._recurrent_steps[bp]
        lora = self.lora.fixed_step(self._slots[:bp]) if key.adapters else contextlib.nullcontext()
        with lora:
            out = self.model(
                input_ids=self._vec[0, :bp][None],
                position_ids=self._vec[1, :bp][None],
                use_cache=False,
                logits_to_keep=self._vec[4, : min(bp, self._num_sampled)],
                kv_meta=meta,
                **extra,
            )
        return out.logits[0]

    def _captured(self, key: tuple, fn) -> bool:
        """Capture fn() for `key`; False: no graph. A capture that ran out of memory is retried once after
        handing the allocator's cache back (memory it holds may be what the graph's pool lacked); no other
        failure is: a capture that CUDA cut off can leave PyTorch's allocator mid-capture (before 2.12),
        where emptying its cache fails too."""
        failure: Exception | None = None
        for attempt in range(2):
            try:
                self._capture(key, fn)
                return True
            except torch.cuda.OutOfMemoryError as exc:
                failure = exc
                if attempt == 0:
                    torch.cuda.empty_cache()
            except Exception as exc:  # noqa: BLE001 -- any failed capture: eager steps, said once in the log
                failure = exc
                break
        logger.error("capturing a CUDA graph for a step failed; steps run eagerly from now on (start with "
                     "--enforce-eager to skip the attempt)", exc_info=failure)
        return False

    def _capture(self, key: tuple, fn) -> None:
        """Warm fn() up and capture it, both on a side stream that follows the engine's. Not through
        `torch.cuda.graph`, whose entry synchronizes the whole device and empties the allocator's cache:
        beside a trainer in this process (`serve.ServerThread`) that would wait for the trainer's queued
        kernels and hand back its cached memory at every capture. thread_local: other threads (HTTP,
        a trainer) may use CUDA while the engine thread captures. One side stream, so the memory the
        warm-ups cache on it is found again by the next one, of the highest priority: a graph's kernels
        keep the priority of the stream that captured them (PyTorch instantiates graphs with node
        priorities), whatever stream replays them, and the engine of a server inside a trainer's process
        runs at that priority; a server alone in its process has no other stream for it to matter."""
        start = time.perf_counter()
        if self._capture_stream is None:
            self._capture_stream = torch.cuda.Stream(self.device, priority=HIGHEST_PRIORITY)
        stream = self._capture_stream
        stream.wait_stream(torch.cuda.current_stream(self.device))
        graph = torch.cuda.CUDAGraph()
        kind = key[0]
        with torch.cuda.stream(stream):
            self._warm_up(key, fn)
            graph.capture_begin(pool=self._pools.get(kind), capture_error_mode="thread_local")
            try:
                out = fn()
            finally:
                graph.capture_end()
        torch.cuda.current_stream(self.device).wait_stream(stream)
        self._pools.setdefault(kind, graph.pool())
        self._graphs[key] = (graph, out)
        self.num_captures += 1
        self.capture_s += time.perf_counter() - start
        logger.info("captured a graph %s (%d graphs)", key, len(self._graphs))

    def _warm_up(self, key: tuple, fn) -> None:
        """fn() once before its capture (first-use set-up), after which the replay runs the step. The
        keys and values it writes, the replay writes again, but a DeltaNet state it advanced the replay
        would advance twice: with recurrent state the warm-up reads and writes the scratch slot (its
        keys and values, computed from that state, the replay overwrites before any layer reads them)."""
        if self.recurrent is None or key[0] != "forward":
            fn()
            return
        rows = self._state_rows[: key[1]]
        held = rows.clone()
        rows.fill_(self.recurrent.scratch_row)
        try:
            fn()
        finally:
            rows.copy_(held)
