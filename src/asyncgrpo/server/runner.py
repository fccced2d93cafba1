"""Model runner: one scheduled step -> one forward pass -> one sampled token per sequence.

Builds the flat step (decode tokens first, then the chunks of prompts to prefill, each after what
the cache holds: a cached prefix or earlier chunks), runs the Hugging Face model with the paged
attention (`kv_cache.py`), keeps only the last position of each sampled sequence for the LM head, applies the
per-request logits processors and `sampling.sample`, and queues the results' way to the host in ONE
transfer per step (`step_output.py`): `launch` returns before the device is done, so the engine may
plan and launch the next step meanwhile, whose decode rows read their last tokens on the device.
With CUDA graphs (`step_graphs.py`), decode steps replay one, and so do steps whose prompt chunks
are all short (`step_rows.prompt_rows`: every chunk token a row of the decode attention); other steps
run the eager forward. How each part of a step attends (decode rows, shared prompt blocks, prompt
chunks packed or padded, short chunks as rows) is the execution plan's (`attention/plan.py`), resolved
once at load: the runner lays every step out through it and never decides again.

Host work per step is a few array operations over the step's rows rather than a loop over the
sequences' parameters: a sequence's sampling parameters are written into `RowParams` when it
enters a scheduler row (it is then in the step's prefill list, the only way into a row), and each
step gathers them by row.
"""

from __future__ import annotations

import contextlib

import numpy as np
import torch

from asyncgrpo.server.attention.plan import ExecutionPlan
from asyncgrpo.server.attention.shared_prefix import SharedPrefixes, find_shared_prefixes
from asyncgrpo.server.host_copy import to_device
from asyncgrpo.server.kv_cache import PagedKVCache
from asyncgrpo.server.lora import ServedLora
from asyncgrpo.server.recurrent_state import STEP_KWARG, RecurrentState
from asyncgrpo.server.sampling import (
    SamplingPlan,
    apply_repetition_penalty,
    pack,
    plan_columns,
    row_hash,
    sample,
    seed_hash,
    token_hash,
)
from asyncgrpo.server.sequence import Sequence
from asyncgrpo.server.step_graphs import StepGraphs
from asyncgrpo.server.step_output import LaunchedStep, StepOutput
from asyncgrpo.server.step_rows import StepRows, decode_inputs, prompt_rows


class RowParams:
    """Per-row sampling parameters of the running sequences (host arrays indexed by scheduler row)."""

    def __init__(self, num_rows: int) -> None:
        self.temperature = np.zeros(num_rows, dtype=np.float32)
        self.top_p = np.ones(num_rows, dtype=np.float32)
        self.min_p = np.zeros(num_rows, dtype=np.float32)
        self.top_k = np.zeros(num_rows, dtype=np.int64)
        self.seed_hash = np.zeros(num_rows, dtype=np.int64)  # sampling.seed_hash of the seed
        self.prompt_len = np.zeros(num_rows, dtype=np.int64)
        self.min_tokens = np.zeros(num_rows, dtype=np.int64)
        self.num_top_logprobs = np.zeros(num_rows, dtype=np.int64)  # 0 when none are asked for
        self.mask_width = np.zeros(num_rows, dtype=np.int64)  # top_k of rows that return masks, else 0
        self.penalised = np.zeros(num_rows, dtype=bool)  # repetition_penalty != 1
        self.lora_slot = np.full(num_rows, -1, dtype=np.int64)  # LoRA slot, -1: the base model

    def admit(self, seqs: list[Sequence]) -> None:
        """Write the parameters of sequences that just entered their rows."""
        rows = [s.row for s in seqs]
        ps = [s.params for s in seqs]
        self.temperature[rows] = [p.temperature for p in ps]
        self.top_p[rows] = [p.top_p for p in ps]
        self.min_p[rows] = [p.min_p for p in ps]
        self.top_k[rows] = [p.top_k for p in ps]
        self.seed_hash[rows] = seed_hash(np.array([p.seed for p in ps], dtype=np.int64))
        self.prompt_len[rows] = [len(s.prompt) for s in seqs]
        self.min_tokens[rows] = [p.min_tokens for p in ps]
        self.num_top_logprobs[rows] = [p.logprobs or 0 for p in ps]
        self.mask_width[rows] = [p.top_k if p.want_mask else 0 for p in ps]
        self.penalised[rows] = [p.repetition_penalty != 1.0 for p in ps]
        self.lora_slot[rows] = [s.lora_slot for s in seqs]


class ModelRunner:
    """Owns the model, the KV pools and the device; called from the engine thread only."""

    def __init__(
        self,
        model: torch.nn.Module,
        cache: PagedKVCache,
        plan: ExecutionPlan,
        vocab_size: int,
        block_table: np.ndarray,
        graphs: StepGraphs | None = None,
        recurrent: RecurrentState | None = None,
        lora: ServedLora | None = None,
    ) -> None:
        """plan: how each part of a step attends (`attention.plan.resolve_plan`, on the cache's device).
        block_table: the scheduler's, one row per running sequence. graphs: steps of rows through static
        buffers (CUDA graphs), built with the same plan. recurrent: a hybrid's DeltaNet state. lora: the
        served LoRA adapters."""
        assert graphs is None or graphs.plan is plan, "the graphs replay steps laid out by the runner's plan"
        assert graphs is None or graphs.recurrent is recurrent, (
            "the graphs carry the runner's recurrent state")
        assert graphs is None or graphs.lora is lora, "the graphs add the deltas of the runner's adapters"
        self.model = model
        self.cache = cache
        self.plan = plan
        self.device = plan.device
        self.vocab_size = vocab_size
        self.block_table = block_table  # the scheduler's, one row per running sequence
        self.graphs = graphs  # decode-only steps through static buffers (CUDA graphs) when set
        self.recurrent = recurrent  # the DeltaNet layers' per-row state of a hybrid model
        self.lora = lora  # stacked LoRA adapters (--enable-lora): each token's slot is set per step
        self.params = RowParams(block_table.shape[0])
        self._shared: tuple[tuple, SharedPrefixes | None] = ((), None)  # the last decode set and its groups
        self.token_hashes = token_hash(torch.arange(vocab_size, device=self.device))
        self.wait_s = 0.0  # seconds the host waited for the device's step outputs
        self.kv_tokens = 0  # context tokens the last launch's decode rows attend over, shared parts once
        self._last_sampled: torch.Tensor | None = None  # [B] token ids the last launch sampled (device)

    def step(self, decode: list[Sequence], prefill: list[Sequence]) -> StepOutput:
        """`launch` a step and wait for what it sampled."""
        return self.launch(decode, prefill).result()

    def needs_known_tokens(self, seqs: list[Sequence]) -> bool:
        """Whether a step over some of `seqs` may need the ids of pending tokens on the host (a repetition
        penalty reads every token of its sequence): the step in flight must be recorded first."""
        return bool(self.params.penalised.any()) and any(
            s.pending and self.params.penalised[s.row] for s in seqs)

    @torch.inference_mode()
    def launch(self, decode: list[Sequence], prefill: list[Sequence]) -> LaunchedStep:
        """Queue one forward pass over `decode` + `prefill` (in that order) and the sampling of decode and
        the prefills whose chunk reaches their last token (the scheduler's `StepPlan.sampled`), whose
        tokens become pending (`Sequence.launch`). A decode sequence's own pending token, sampled by the
        previous launch, is read on the device, so this may run before that step's output is recorded."""
        if prefill:
            self.params.admit(prefill)  # again at every chunk: cheap, and rows never change mid-prompt
            # a prefilled sequence may be a preempted one back on other blocks: find the groups again
            self._shared = ((), None)
        done = [s for s in prefill if s.prefill_end == s.num_tokens]
        seqs = decode + done
        rows = np.fromiter((s.row for s in seqs), dtype=np.int64, count=len(seqs))
        num_tokens = np.fromiter((s.num_tokens for s in seqs), dtype=np.int64, count=len(seqs))
        dec, pending = None, None
        self.kv_tokens = 0
        if decode:
            nd = len(decode)
            # last_token: a prompt whose last chunk stopped one token short computes it as a decode
            last = np.fromiter((0 if s.pending else s.last_token() for s in decode), dtype=np.int64, count=nd)
            dec = decode_inputs(last, num_tokens[:nd], rows[:nd], self.block_table, self.cache.block_size)
            if self.plan.shared_members:
                dec.shared = self._shared_prefixes(decode, dec)
            self.kv_tokens = dec.kv_tokens
            pending = self._pending_tokens(decode)
        if not seqs:  # only chunks in the middle of prompts: their KV, nothing to sample
            self._forward(dec, prefill, rows[: len(decode)], pending)
            return LaunchedStep(None, None, 0, 0)
        positions = num_tokens - self.params.prompt_len[rows]  # index of the token being drawn
        plan = self._plan(rows, positions)
        if self.graphs is not None and (not prefill or self._fits_rows(prefill)):
            if prefill:
                dec = prompt_rows(dec, prefill, self.block_table, self.cache.block_size,
                                  self.plan.row_members, self.cache.scratch_block)
            if self.lora is not None:
                dec.lora_slots = self.params.lora_slot[dec.seq_rows]
            logits = self.graphs.run(dec, pending)
            packed = None
            if not self._needs_processing(rows, positions):
                packed = self.graphs.sample(logits, plan, self.token_hashes)
        else:
            logits = self._forward(dec, prefill, rows[: len(decode)], pending)
            packed = None
        if packed is None:
            logits = self._process(logits.float(), seqs, rows, positions)
            floats = to_device(plan.floats, self.device)
            ints = to_device(plan.ints, self.device)
            packed = pack(sample(logits, plan.batch(floats, ints, self.token_hashes)))
        self._last_sampled = packed[:, 0].long()  # the next launch reads its pending tokens here
        for i, seq in enumerate(seqs):
            seq.launch(i)
        return LaunchedStep.queue(packed, plan, self._waited)

    def _waited(self, seconds: float) -> None:
        self.wait_s += seconds

    def _pending_tokens(self, decode: list[Sequence]) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(decode rows, their tokens on the device) for the sequences whose last token is pending:
        sampled by the previous launch, at its `sample_index` row."""
        rows = [i for i, s in enumerate(decode) if s.pending]
        if not rows:
            return None
        assert all(decode[i].pending == 1 for i in rows), "one step in flight at most"
        src = np.fromiter((decode[i].sample_index for i in rows), np.int64, len(rows))
        index = to_device(np.stack([np.asarray(rows, np.int64), src]), self.device)
        return index[0], self._last_sampled.index_select(0, index[1])

    def _forward(self, dec: StepRows | None, prefill: list[Sequence], decode_rows: np.ndarray,
                 pending: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """Eager flat step: any mix of decode tokens (of the scheduler rows `decode_rows`, `pending` their
        tokens still on the device) and prompt chunks. Returns logits [B, V]."""
        bs = self.cache.block_size
        ids, pos, slots = ([dec.token_ids], [dec.positions], [dec.slots]) if dec else ([], [], [])
        prefill_lens, starts = [], []
        for s in prefill:
            # tokens before prefill_start are in the cache (a cached prefix or earlier chunks)
            start, end = s.prefill_start, s.prefill_end
            p = np.arange(start, end)
            ids.append(np.asarray(s.all_tokens()[start:end], dtype=np.int64))
            pos.append(p)
            slots.append(self.block_table[s.row, p // bs] * bs + p % bs)
            prefill_lens.append(end - start)
            starts.append(start)
        flat = to_device(np.stack([np.concatenate(ids), np.concatenate(pos)]), self.device)
        if pending is not None:
            flat[0].index_copy_(0, *pending)
        num_decode = 0 if dec is None else len(dec.token_ids)
        ends = num_decode + np.cumsum(prefill_lens, dtype=np.int64) - 1
        sampled = np.fromiter((s.prefill_end == s.num_tokens for s in prefill), dtype=bool,
                              count=len(prefill))
        last = np.concatenate([np.arange(num_decode), ends[sampled]])
        prefill_rows = np.fromiter((s.row for s in prefill), np.int64, len(prefill))
        meta = self.plan.attention(
            self.cache,
            np.concatenate(slots),
            None if dec is None else torch.from_numpy(dec.block_tables),
            [] if dec is None else dec.context_lens,
            prefill_lens,
            starts,
            self.block_table[prefill_rows],  # each sequence's blocks, as its `blocks` list holds them
            None if dec is None else dec.shared,
        )
        extra = {}
        if self.recurrent is not None:
            rows = np.concatenate([decode_rows, prefill_rows])
            extra[STEP_KWARG] = self.recurrent.step(rows, len(decode_rows), prefill_lens, starts)
        adapters = contextlib.nullcontext()
        if self.lora is not None:  # each token's adapter slot: its sequence's
            slots = self.params.lora_slot
            adapters = self.lora.step(
                np.concatenate([slots[decode_rows], np.repeat(slots[prefill_rows], prefill_lens)]))
        with adapters:
            out = self.model(
                input_ids=flat[0][None],
                position_ids=flat[1][None],
                use_cache=False,
                logits_to_keep=to_device(last, self.device),
                kv_meta=meta,
                **extra,
            )
        return out.logits[0]

    def _fits_rows(self, prefill: list[Sequence]) -> bool:
        """Whether a step's prompt chunks run as rows of a graph's decode attention (`prompt_rows`): where
        the plan has the rows layout, with few enough rows for the graphs' buffers, reading little enough."""
        rows = self.plan.rows
        if rows is None or not self.graphs.max_prompt_rows or self.recurrent is not None:
            return False  # (a DeltaNet layer runs prompt chunks with its chunked rule, not as rows)
        lens = np.fromiter((s.prefill_end - s.prefill_start for s in prefill), np.int64, len(prefill))
        if lens.sum() > self.graphs.max_prompt_rows:
            return False
        starts = np.fromiter((s.prefill_start for s in prefill), np.int64, len(prefill))
        return rows.fits_graph(lens, starts)

    def _shared_prefixes(self, decode: list[Sequence], dec: StepRows) -> SharedPrefixes | None:
        """The groups of the decode sequences that share their first blocks, found again only when the
        decode set (or a released block) changed since the last step without prefills: blocks shared at
        admission stay shared and in place while the sequences run."""
        key = tuple((s.seq_id, s.released) for s in decode)
        if key != self._shared[0]:
            found = find_shared_prefixes(dec.block_tables, dec.context_lens, self.cache.block_size,
                                         self.plan.shared_members, self.cache.scratch_block)
            self._shared = (key, found)
        return self._shared[1]

    def _needs_processing(self, rows: np.ndarray, positions: np.ndarray) -> bool:
        """Whether `_process` changes any row's logits this step."""
        return bool(self.params.penalised[rows].any() or (positions < self.params.min_tokens[rows]).any())

    def _process(
        self, logits: torch.Tensor, seqs: list[Sequence], rows: np.ndarray, positions: np.ndarray
    ) -> torch.Tensor:
        """Logits processors before temperature: repetition penalty and the min_tokens ban."""
        pen_rows = np.flatnonzero(self.params.penalised[rows]).tolist()
        assert not any(seqs[i].pending for i in pen_rows), "a penalty needs every token on the host"
        if pen_rows:
            rows_idx, cols = [], []
            for i in pen_rows:
                toks = set(seqs[i].all_tokens())
                rows_idx.extend([i] * len(toks))
                cols.extend(toks)
            seen = torch.zeros_like(logits, dtype=torch.bool)
            index = to_device(np.array([rows_idx, cols], dtype=np.int64), self.device)
            seen[index[0], index[1]] = True
            penalty = to_device(np.array([s.params.repetition_penalty for s in seqs], np.float32),
                                self.device)
            logits = apply_repetition_penalty(logits, seen, penalty)
        rows_idx, cols = [], []
        for i in np.flatnonzero(positions < self.params.min_tokens[rows]).tolist():
            banned = [t for t in seqs[i].params.stop_ids if t < self.vocab_size]
            rows_idx.extend([i] * len(banned))
            cols.extend(banned)
        if rows_idx:  # (a fill on the device: a host scalar would be a copy that waits for it)
            index = to_device(np.array([rows_idx, cols], dtype=np.int64), self.device)
            logits = logits.index_put((index[0], index[1]), torch.full((), float("-inf"), device=self.device))
        return logits

    def _plan(self, rows: np.ndarray, positions: np.ndarray) -> SamplingPlan:
        p = self.params
        top_k, top_p = p.top_k[rows], p.top_p[rows]
        num_top = int(p.num_top_logprobs[rows].max())
        mask_width = int(p.mask_width[rows].max())
        return SamplingPlan(
            floats=np.stack([p.temperature[rows], top_p, p.min_p[rows]]),
            ints=np.stack([top_k, row_hash(p.seed_hash[rows], positions)]),
            num_sorted=plan_columns(top_k, top_p, num_top, mask_width, self.vocab_size),
            num_top_logprobs=num_top,
            mask_width=mask_width,
            all_top_k=bool((top_k > 0).all()),
        )
