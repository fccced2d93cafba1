"""A sequence: one generated continuation of a request, and its sampling parameters.

Its mutable state is touched by the engine thread only (scheduler.py plans it, the model runner
launches its tokens, `append` records them and applies vLLM's stop rules); the HTTP side reads the
output lists up to the indices the engine hands it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from asyncgrpo.server.prefix_cache import ROOT_HASH


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
    blocks: list[int] = field(default_factory=list)  # its block table: block of tokens [i * bs, (i + 1) * bs)
    released: int = 0  # leading blocks released as out of every layer's window (null in `blocks`)
    block_hashes: list[bytes] = field(default_factory=list)  # of the first full blocks of all_tokens()
    cache_epoch: int = -1  # BlockPool.epoch at admission: blocks of another epoch are never registered
    num_computed: int = 0  # tokens whose KV is in the cache once the planned steps ran
    prefill_start: int = 0  # while prefilling: this step computes tokens [prefill_start, prefill_end)
    prefill_end: int = 0
    row: int = -1  # row of the scheduler's block table while running
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    error: str | None = None
    sink: object = None  # set by the engine: where outputs are delivered
    lora_slot: int = -1  # slot of its LoRA adapter (server/lora.py), -1: the base model
    hash_root: bytes = ROOT_HASH  # first parent of its block hashes (an adapter's own, see lora.py)
    # tokens that launched steps sample for it and that are not recorded yet (asynchronous steps, see
    # engine.py): counted in num_tokens, not in output; `sample_index` is its row in the last launch's output
    pending: int = 0
    sample_index: int = -1

    num_tokens: int = field(init=False)  # len(prompt) + len(output) + pending, kept by launch and append

    def __post_init__(self) -> None:
        self.num_tokens = len(self.prompt) + len(self.output)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None or self.error is not None

    @property
    def num_known(self) -> int:
        """Tokens whose ids the host has: the prompt and the recorded output."""
        return len(self.prompt) + len(self.output)

    @property
    def ends_by_length(self) -> bool:
        """A pending token reaches max_tokens or max_model_len: the sequence ends with it, whatever it is
        (so no later step computes it)."""
        return self.pending > 0 and (
            len(self.output) + self.pending >= self.params.max_tokens
            or self.num_tokens >= self.max_model_len)

    def launch(self, sample_index: int) -> None:
        """A launched step samples this sequence's next token (row `sample_index` of its output)."""
        assert not self.finished, "a finished sequence is never launched"
        self.pending += 1
        self.num_tokens += 1
        self.sample_index = sample_index

    def last_token(self) -> int:
        assert not self.pending, "the last token is still on the device"
        return self.output[-1] if self.output else self.prompt[-1]

    def all_tokens(self) -> list[int]:
        return self.prompt + self.output

    def top(self, i: int) -> tuple[list[int], list[float]]:
        """Top-K ids and log-probs of output token i (K = params.logprobs)."""
        k = self.params.logprobs or 0
        return self.top_ids[i * k : (i + 1) * k], self.top_logprobs[i * k : (i + 1) * k]

    def append(self, token: int, logprob: float, rank: int, version: str) -> None:
        """Record a sampled token (its log-prob and rank) and apply vLLM's stop rules (EOS, stop ids,
        lengths). The token is a pending one (launched) or, from callers that do not launch, a new one."""
        n = len(self.output)
        self.output.append(token)
        self.logprobs.append(logprob)
        self.ranks.append(rank)
        if self.pending:
            self.pending -= 1
        else:
            self.num_tokens += 1
        if self.spans and self.spans[-1][0] == version:
            self.spans[-1][2] = n + 1
        else:
            self.spans.append([version, n, n + 1])
        p = self.params
        if n + 1 >= p.min_tokens:
            if p.eos_token_id is not None and token == p.eos_token_id:
                self.finish_reason = "stop"
            elif token in p.stop_token_ids or token in p.extra_eos_ids:
                self.finish_reason, self.stop_reason = "stop", token
        if self.finish_reason is None and (n + 1 >= p.max_tokens or self.num_known >= self.max_model_len):
            self.finish_reason = "length"
        if self.finish_reason is not None:  # tokens a later launched step samples for it are dropped
            self.pending = 0
            self.num_tokens = self.num_known
