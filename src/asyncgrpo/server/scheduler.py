"""Continuous-batching scheduler: which sequences run in the next forward pass.

State (touched only by the engine thread):

    waiting  deque  FCFS; new sequences and preempted ones (at the front, re-prefilled later)
    running  list   sequences with their KV in the cache, in admission order (youngest last)

Each step spends at most `max_num_batched_tokens` tokens:

    1. decode    every running sequence whose prompt is in the cache computes one token (a new block
                 is taken when its last one is full); when the pool runs dry the youngest running
                 sequence is preempted (blocks freed, pushed back to the front of `waiting`, it
                 re-prefills prompt + generated tokens later)
    2. chunks    running sequences still prefilling (oldest first) compute their next chunk
    3. admit     waiting sequences enter while there are blocks, sequence slots and budget; a prompt
                 longer than what is left of the budget is prefilled in chunks over the next steps
                 (chunked prefill: one long prompt never stalls the running decodes). With
                 `admission_interval` n > 1, a step that would otherwise decode only admits no one
                 unless n - 1 such steps went by without admission: requests arriving one by one
                 (the next turns of conversations, spread by their HTTP round trips) then enter
                 together, and most steps stay decode-only (a CUDA graph replay, where a step with
                 prompt tokens runs eagerly at several times its cost); a request waits at most
                 n - 1 steps more

A sequence's state is `num_computed`, the tokens whose KV the planned steps put in the cache; a
prefill entry of a step computes tokens [prefill_start, prefill_end) and samples only when that
reaches the last token (`StepPlan.sampled`). Stop rules live in `Sequence.append`.

Asynchronous steps (engine.py): the next step is planned while the last one runs, so a sequence may
have a `pending` token, sampled on the device and not recorded yet. Planning needs only how many
tokens a sequence has, not their ids, so a pending token counts in `num_tokens` (the next step
computes its KV, its id taken on the device); a pending token that ends the sequence by length stops
it from being planned again, and one that turns out to be a stop token makes the next step's sample
for it dropped. Hashing a block needs its ids: a block that ends in a pending token is registered
when the token is recorded (`recorded`).

Prefix caching (`prefix_cache.BlockPool`): an admitted sequence takes the longest cached prefix of
its tokens (whole blocks, at most all tokens but the last, which must be computed to sample) and is
prefilled from there. Blocks are registered under their hash when the step that computes them is
planned, so a sequence admitted later in the same step already shares them (a step writes every
token's K/V before any attention reads the cache). Only sequences whose KV was all computed under
the current weights (`cache_epoch`) register blocks.

Sliding-window models (`window`: every layer with keys/values has a window; None when one attends
over the whole context): the next token of a sequence reads no key before num_computed - window + 1,
so each step first releases the blocks wholly before that point (vLLM's sliding-window manager does
the same). A released entry of the block table points at the null block (the KV cache's scratch
block), which the attention masks out. Such a sequence takes blocks chunk by chunk, not its whole
prompt at admission, so it holds about window + chunk tokens at any time and admission counts only
that. A released block keeps its hash (it goes back to the pool as cached, evictable first), but the
sequence cannot read it again: a later request extending it matches with `BlockPool.match_tail`,
which needs only the blocks inside the window of the hit's end, as the earlier ones may be gone.
Models that mix global layers in (Gemma 2/3, Cohere2) hold every block: the global layers read
them all, and one block table serves every layer. Freeing the windowed layers' share of a block
would need a block table per layer group (vLLM's hybrid KV-cache manager): pools sized per group,
two block lists per sequence, slot mappings, decode tables, graph buffers and prefix-cache hits per
group. It would save KV memory, not step time (which blocks are held does not change what the
windowed layers' decode attention reads), so it is left for when long-context Gemma serving runs
out of KV blocks.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field

import numpy as np

from asyncgrpo.server.prefix_cache import BlockPool, extend_block_hashes
from asyncgrpo.server.sequence import Sequence


@dataclass
class StepPlan:
    """One step: `decode` sequences compute one token each, `prefill` ones a chunk of their prompt
    (those starting at token 0 first); `sampled` = decode + the prefills that reach their last token."""

    decode: list[Sequence]
    prefill: list[Sequence]
    preempted: list[Sequence]
    sampled: list[Sequence] = field(default_factory=list)

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
        window: int | None = None,
        admission_interval: int = 1,
    ) -> None:
        assert admission_interval >= 1, admission_interval
        self.pool = pool
        self.admission_interval = admission_interval
        self._steps_without_admission = 0  # decode-only steps in a row that left `waiting` alone
        self.window = window  # attention_math.kv_window of the model
        self.null_block = pool.num_blocks  # the KV cache's scratch block: released entries point there
        # the blocks a prefix hit needs cached: those the window of its next token reaches
        self._hit_tail = max(1, -(-(window - 1) // block_size)) if window is not None else 0
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
        self.pool.free(seq.blocks[seq.released :])
        seq.blocks = []
        seq.released = 0
        if seq.row >= 0:
            self._free_rows.append(seq.row)
            seq.row = -1

    def _release_skipped(self, seq: Sequence) -> None:
        """Release seq's blocks that lie wholly before the window of its next token (num_computed)."""
        skip = min(max(0, seq.num_computed - self.window + 1) // self.block_size, len(seq.blocks))
        if skip > seq.released:
            self.pool.free(seq.blocks[seq.released : skip])
            seq.blocks[seq.released : skip] = [self.null_block] * (skip - seq.released)
            self.block_table[seq.row, seq.released : skip] = self.null_block
            seq.released = skip

    def _grow(self, seq: Sequence, n: int) -> None:
        start = len(seq.blocks)
        seq.blocks.extend(self.pool.allocate(n))
        self.block_table[seq.row, start : len(seq.blocks)] = seq.blocks[start:]

    def preempt(self, seq: Sequence) -> None:
        """Free a running sequence's KV and queue it (first) for a fresh prefill."""
        self.running.remove(seq)
        self._release(seq)
        seq.num_computed = 0
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
        """Register seq's full blocks from `first_block` up to `num_computed` tokens (planned this step)
        whose tokens are known (a block ending in a pending token is registered when it is recorded)."""
        end = min(num_computed, seq.num_known) // self.block_size
        if end <= first_block or seq.cache_epoch != self.pool.epoch or not self.pool.enable_caching:
            return
        hashes = extend_block_hashes(seq.block_hashes, seq.all_tokens(), self.block_size, end, seq.hash_root)
        for i in range(first_block, end):
            self.pool.register(seq.blocks[i], hashes[i])

    def recorded(self, seq: Sequence) -> None:
        """A running sequence's pending token was recorded: register the block it completes, if a planned
        step computes its KV (what `schedule` left for later, the token being unknown then)."""
        known = seq.num_known
        if known % self.block_size == 0 and known <= seq.num_computed:
            self._register(seq, known // self.block_size - 1, known)

    def _cached_prefix(self, seq: Sequence) -> list[int]:
        """Blocks of the longest cached prefix of seq's tokens, leaving at least its last token to compute
        (with a window: null up to the blocks its window reaches)."""
        if not self.pool.enable_caching:
            return []
        usable = (seq.num_tokens - 1) // self.block_size
        hashes = extend_block_hashes(seq.block_hashes, seq.all_tokens(), self.block_size, usable,
                                     seq.hash_root)
        if self.window is None:
            return self.pool.match(hashes[:usable])
        n, tail = self.pool.match_tail(hashes[:usable], self._hit_tail)
        return [self.null_block] * (n - len(tail)) + tail

    def _plan_chunk(self, seq: Sequence, budget: int) -> int:
        """Plan seq's next prefill chunk within `budget` tokens (> 0); returns its size."""
        start = seq.num_computed
        end = min(seq.num_tokens, start + budget)
        if self.window is not None:  # blocks are taken chunk by chunk, as far as the pool allows
            end = min(end, (len(seq.blocks) + self.pool.num_free) * self.block_size)
            self._grow(seq, self._blocks_for(end) - len(seq.blocks))
        seq.prefill_start, seq.prefill_end = start, end
        self._register(seq, start // self.block_size, end)
        seq.num_computed = end
        return end - start

    def schedule(self) -> StepPlan:
        preempted: list[Sequence] = []
        # 1. decode: one more slot for every running sequence past its prompt (a new block for those
        # whose last one is full; with a window, also for a prompt whose next chunk needs one, after
        # releasing what fell out of the window), preempting the youngest while the pool is short
        bs = self.block_size
        if self.window is not None:
            for s in self.running:
                self._release_skipped(s)
        # (a sequence whose pending token ends it by length computes nothing more: it leaves when recorded)
        growing = [s for s in self.running if s.num_computed >= len(s.blocks) * bs and not s.ends_by_length]
        while len(growing) > self.pool.num_free:
            victim = self.running[-1]
            self.preempt(victim)
            preempted.append(victim)
            if growing and growing[-1] is victim:  # both lists keep admission order
                growing.pop()
        for s in growing:
            self._grow(s, 1)
        decode = [s for s in self.running if s.num_computed == s.num_tokens - 1 and not s.ends_by_length]
        for s in decode:
            s.num_computed = s.num_tokens
            if s.num_tokens % bs == 0:  # this step computes token num_tokens - 1, the last of its block
                self._register(s, s.num_tokens // bs - 1, s.num_tokens)
        budget = self.max_num_batched_tokens - len(decode)
        # 2. chunks of the prompts still being prefilled, oldest first
        prefill: list[Sequence] = []
        for s in self.running:
            if budget <= 0:
                break
            if s.num_computed < s.num_tokens - s.pending:  # not decoding: a prompt whose chunks are not done
                budget -= self._plan_chunk(s, budget)
                prefill.append(s)
        # 3. admit FCFS while slots, blocks and the token budget allow (in a step that would decode
        # only, every admission_interval steps)
        hold = bool(decode) and not prefill and self._steps_without_admission + 1 < self.admission_interval
        self._steps_without_admission = self._steps_without_admission + 1 if hold and self.waiting else 0
        while not hold and self.waiting and len(self.running) < self.max_num_seqs and budget > 0:
            seq = self.waiting[0]
            if (preempted and seq in preempted) or seq.pending:
                break  # do not re-admit what this step just evicted, nor what has tokens on the device
            hit = self._cached_prefix(seq)
            held = [b for b in hit if b != self.null_block]
            # blocks for the whole prompt, or with a window for its first chunk only (see _plan_chunk)
            end = seq.num_tokens if self.window is None else min(seq.num_tokens, len(hit) * bs + budget)
            need = self._blocks_for(end) - len(hit)
            if need + self.pool.num_evictable(held) > self.pool.num_free:
                break
            self.waiting.popleft()
            self.pool.record_query(seq.num_tokens, len(hit) * bs)
            self.pool.touch(held)
            seq.blocks = list(hit)
            seq.released = len(hit) - len(held)
            seq.row = self._free_rows.pop()
            self.block_table[seq.row, : len(hit)] = hit
            self._grow(seq, need)
            seq.num_computed = len(hit) * bs
            seq.cache_epoch = self.pool.epoch
            budget -= self._plan_chunk(seq, budget)
            self.running.append(seq)
            prefill.append(seq)
        # the attention takes prompts from token 0 first, then the chunks after cached tokens shortest first
        prefill.sort(key=lambda s: (s.prefill_start > 0,
                                    s.prefill_end - s.prefill_start if s.prefill_start else 0))
        sampled = decode + [s for s in prefill if s.prefill_end == s.num_tokens]
        return StepPlan(decode=decode, prefill=prefill, preempted=preempted, sampled=sampled)
