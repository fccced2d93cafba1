"""Continuous-batching scheduler: which sequences run in the next forward pass.

State (touched only by the engine thread):

    waiting  deque  FCFS; new sequences and preempted ones (at the front, re-prefilled later)
    running  list   sequences with their KV in the cache, in admission order (youngest last)

Each step: every running sequence decodes one token (a new block is taken when its last one is
full); when the pool runs dry the youngest running sequence is preempted (blocks freed, pushed back
to the front of `waiting`, it re-prefills prompt + generated tokens later). Then waiting sequences
are admitted for prefill while there are blocks, sequence slots and token budget. Stop rules live in
`Sequence.append`.

Prefix caching (`prefix_cache.BlockPool`): an admitted sequence takes the longest cached prefix of
its tokens (whole blocks, at most all tokens but the last, which must be computed to sample) and is
prefilled from there (`Sequence.prefill_start`). Blocks are registered under their hash when the step
that computes them is planned, so a sequence admitted later in the same step already shares them (a
step writes every token's K/V before any attention reads the cache). Only sequences whose KV was all
computed under the current weights (`cache_epoch`) register blocks.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field

import numpy as np

from asyncgrpo.server.prefix_cache import BlockPool, extend_block_hashes


@dataclass(frozen=True)
class SeqParams:
    """Validated sampling parameters of one sequence (one child of a request)."""

    temperature: float
    top_k: int  # 0 = off
    top_p: float
    min_p: float
    seed: int
    max_tokens: int  # already clamped to max_model_len - prompt_len where the route requires it
    min_tokens: int
    stop_token_ids: frozenset[int]
    eos_token_id: int | None  # primary EOS (stop_reason None); None with ignore_eos
    extra_eos_ids: frozenset[int]  # other EOS ids of the generation config (stop_reason = id)
    logprobs: int | None  # top-K log-probs per token, None = none
    want_mask: bool
    repetition_penalty: float = 1.0

    @property
    def stop_ids(self) -> frozenset[int]:
        """Every id that may end the sequence (banned before min_tokens)."""
        ids = set(self.stop_token_ids) | set(self.extra_eos_ids)
        if self.eos_token_id is not None:
            ids.add(self.eos_token_id)
        return frozenset(ids)


@dataclass(eq=False)
class Sequence:
    """One generated continuation; output lists only grow, finished sequences never change."""

    seq_id: int
    request_key: str
    index: int  # choice index inside its request
    prompt: list[int]
    params: SeqParams
    max_model_len: int
    output: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)  # of each output token
    ranks: list[int] = field(default_factory=list)
    # top-K lists, flat: K = params.logprobs entries per output token, best first
    top_ids: list[int] = field(default_factory=list)
    top_logprobs: list[float] = field(default_factory=list)
    masks: list[list[int]] = field(default_factory=list)  # candidate ids of each token (want_mask)
    spans: list[list] = field(default_factory=list)  # [version, start, end]
    blocks: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)  # of the first full blocks of all_tokens()
    cache_epoch: int = -1  # BlockPool.epoch at admission: blocks of another epoch are never registered
    prefill_start: int = 0  # tokens found in the prefix cache at admission (prefilled from there)
    row: int = -1  # row of the scheduler's block table while running
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    error: str | None = None
    sink: object = None  # set by the engine: where outputs are delivered

    num_tokens: int = field(init=False)  # len(prompt) + len(output), kept by append

    def __post_init__(self) -> None:
        self.num_tokens = len(self.prompt) + len(self.output)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None or self.error is not None

    def last_token(self) -> int:
        return self.output[-1] if self.output else self.prompt[-1]

    def all_tokens(self) -> list[int]:
        return self.prompt + self.output

    def top(self, i: int) -> tuple[list[int], list[float]]:
        """Top-K ids and log-probs of output token i (K = params.logprobs)."""
        k = self.params.logprobs or 0
        return self.top_ids[i * k : (i + 1) * k], self.top_logprobs[i * k : (i + 1) * k]

    def append(self, token: int, logprob: float, rank: int, version: str) -> None:
        """Record a sampled token (its log-prob and rank) and apply vLLM's stop rules (EOS, stop ids,
        lengths)."""
        n = len(self.output)
        self.output.append(token)
        self.logprobs.append(logprob)
        self.ranks.append(rank)
        self.num_tokens += 1
        if self.spans and self.spans[-1][0] == version:
            self.spans[-1][2] = n + 1
        else:
            self.spans.append([version, n, n + 1])
        p = self.params
        if n + 1 >= p.min_tokens:
            if p.eos_token_id is not None and token == p.eos_token_id:
                self.finish_reason = "stop"
                return
            if token in p.stop_token_ids or token in p.extra_eos_ids:
                self.finish_reason, self.stop_reason = "stop", token
                return
        if n + 1 >= p.max_tokens or self.num_tokens >= self.max_model_len:
            self.finish_reason = "length"


@dataclass
class StepPlan:
    decode: list[Sequence]
    prefill: list[Sequence]
    preempted: list[Sequence]

    @property
    def size(self) -> int:
        return len(self.decode) + len(self.prefill)


class Scheduler:
    """Admission, block accounting and preemption (plain Python, engine thread only)."""

    def __init__(
        self,
        pool: BlockPool,
        block_size: int,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
    ) -> None:
        self.pool = pool
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.running: list[Sequence] = []
        # block table of the running sequences, one row each (the runner reads it without copying lists)
        self.max_blocks = self._blocks_for(max_model_len)
        self.block_table = np.zeros((max_num_seqs, self.max_blocks), dtype=np.int64)
        self._free_rows = list(range(max_num_seqs - 1, -1, -1))

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def kv_usage(self) -> float:
        total = self.pool.num_blocks
        return (total - self.pool.num_free) / total if total else 0.0

    def _blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _release(self, seq: Sequence) -> None:
        self.pool.free(seq.blocks)
        seq.blocks = []
        if seq.row >= 0:
            self._free_rows.append(seq.row)
            seq.row = -1

    def _grow(self, seq: Sequence, n: int) -> None:
        start = len(seq.blocks)
        seq.blocks.extend(self.pool.allocate(n))
        self.block_table[seq.row, start : len(seq.blocks)] = seq.blocks[start:]

    def preempt(self, seq: Sequence) -> None:
        """Free a running sequence's KV and queue it (first) for a fresh prefill."""
        self.running.remove(seq)
        self._release(seq)
        self.waiting.appendleft(seq)

    def preempt_all(self) -> list[Sequence]:
        """Preempt every running sequence, keeping their order at the front of `waiting`."""
        seqs = list(self.running)
        for seq in reversed(seqs):
            self.preempt(seq)
        return seqs

    def remove(self, seq: Sequence) -> None:
        """Drop a sequence wherever it is (finished or aborted) and free its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self._release(seq)

    def reset_prefix_cache(self, reset_running: bool) -> tuple[bool, int]:
        """vLLM's /reset_prefix_cache: (success, sequences preempted). Fails while sequences hold
        blocks, unless reset_running preempts them first (they re-prefill later)."""
        preempted = self.preempt_all() if reset_running else []
        return self.pool.reset(), len(preempted)

    def invalidate_prefix_cache(self) -> None:
        """The weights changed: no block computed before now is found again or registered."""
        self.pool.invalidate()

    def _register(self, seq: Sequence, first_block: int, num_computed: int) -> None:
        """Register seq's full blocks from `first_block` up to `num_computed` tokens (planned this step)."""
        end = num_computed // self.block_size
        if end <= first_block or seq.cache_epoch != self.pool.epoch or not self.pool.enable_caching:
            return
        hashes = extend_block_hashes(seq.block_hashes, seq.all_tokens(), self.block_size, end)
        for i in range(first_block, end):
            self.pool.register(seq.blocks[i], hashes[i])

    def _cached_prefix(self, seq: Sequence) -> list[int]:
        """Blocks of the longest cached prefix of seq's tokens, leaving at least its last token to compute."""
        if not self.pool.enable_caching:
            return []
        usable = (seq.num_tokens - 1) // self.block_size
        hashes = extend_block_hashes(seq.block_hashes, seq.all_tokens(), self.block_size, usable)
        return self.pool.match(hashes[:usable])

    def schedule(self) -> StepPlan:
        preempted: list[Sequence] = []
        # 1. decode: one more slot for every running sequence (a new block for those whose last one
        # is full), preempting the youngest while the pool is short
        bs = self.block_size
        growing = [s for s in self.running if s.num_tokens > len(s.blocks) * bs]
        while len(growing) > self.pool.num_free:
            victim = self.running[-1]
            self.preempt(victim)
            preempted.append(victim)
            if growing and growing[-1] is victim:  # both lists keep admission order
                growing.pop()
        for s in growing:
            self._grow(s, self._blocks_for(s.num_tokens) - len(s.blocks))
        decode = list(self.running)
        if self.pool.enable_caching:
            for s in decode:  # this step computes token num_tokens - 1: its block fills at a boundary
                if s.num_tokens % bs == 0:
                    self._register(s, s.num_tokens // bs - 1, s.num_tokens)
        # 2. prefill: admit FCFS while slots, blocks and the token budget allow (one at least)
        prefill: list[Sequence] = []
        budget = self.max_num_batched_tokens - len(decode)
        while self.waiting and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if preempted and seq in preempted:
                break  # do not re-admit what this step just evicted
            n = seq.num_tokens
            hit = self._cached_prefix(seq)
            new = n - len(hit) * bs
            need = self._blocks_for(n) - len(hit)
            if need + self.pool.num_evictable(hit) > self.pool.num_free or (prefill and new > budget):
                break
            self.waiting.popleft()
            self.pool.record_query(n, len(hit) * bs)
            self.pool.touch(hit)
            seq.blocks = list(hit)
            seq.row = self._free_rows.pop()
            self.block_table[seq.row, : len(hit)] = hit
            self._grow(seq, need)
            seq.prefill_start = len(hit) * bs
            seq.cache_epoch = self.pool.epoch
            self._register(seq, len(hit), n)
            self.running.append(seq)
            prefill.append(seq)
            budget -= new
        return StepPlan(decode=decode, prefill=prefill, preempted=preempted)
