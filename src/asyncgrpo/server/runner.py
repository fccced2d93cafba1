"""Model runner: one scheduled step -> one forward pass -> one sampled token per sequence.

Builds the flat step (decode tokens first, then whole prompts to prefill), runs the Hugging Face
model with the paged attention (`kv_cache.py`), keeps only the last position of each sequence for
the LM head, applies the per-request logits processors and `sampling.sample`, and brings the
results to the host in ONE transfer per step.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from asyncgrpo.server.decode_graphs import DecodeGraphs
from asyncgrpo.server.kv_cache import PagedKVCache, build_metadata
from asyncgrpo.server.sampling import SamplingBatch, apply_repetition_penalty, plan_columns, sample
from asyncgrpo.server.scheduler import Sequence


@dataclass
class TokenOut:
    """Host-side result for one sequence of a step."""

    token: int
    logprob: float
    rank: int
    top: tuple[list[int], list[float]] | None
    mask: list[int] | None


class ModelRunner:
    """Owns the model, the KV pools and the device; called from the engine thread only."""

    def __init__(
        self,
        model: torch.nn.Module,
        cache: PagedKVCache,
        device: torch.device,
        vocab_size: int,
        block_table: np.ndarray,
        graphs: DecodeGraphs | None = None,
    ) -> None:
        self.model = model
        self.cache = cache
        self.device = device
        self.vocab_size = vocab_size
        self.block_table = block_table  # the scheduler's, one row per running sequence
        self.graphs = graphs  # decode-only steps through static buffers (CUDA graphs) when set

    @torch.inference_mode()
    def step(self, decode: list[Sequence], prefill: list[Sequence]) -> list[TokenOut]:
        """Run one forward pass over `decode` + `prefill` (in that order) and sample."""
        seqs = decode + prefill
        if prefill or self.graphs is None:
            logits = self._forward(decode, prefill)
        else:
            logits = self._decode_static(decode)
        logits = self._process(logits.float(), seqs)
        batch = self._sampling_batch(seqs)
        res = sample(logits, batch)
        return self._to_host(res, seqs, batch)

    def _decode_inputs(self, decode: list[Sequence]):
        bs = self.cache.block_size
        ids, pos, slots, lens = [], [], [], []
        for s in decode:
            p = s.num_tokens - 1
            ids.append(s.last_token())
            pos.append(p)
            slots.append(s.blocks[p // bs] * bs + p % bs)
            lens.append(p + 1)
        return ids, pos, slots, lens, self.block_table[[s.row for s in decode]]

    def _decode_static(self, decode: list[Sequence]) -> torch.Tensor:
        ids, pos, slots, lens, tables = self._decode_inputs(decode)
        return self.graphs.run(ids=ids, positions=pos, slots=slots, tables=tables, context_lens=lens)

    def _forward(self, decode: list[Sequence], prefill: list[Sequence]) -> torch.Tensor:
        """Eager flat step: any mix of decode tokens and whole prompts. Returns logits [B, V]."""
        bs = self.cache.block_size
        ids, pos, slots, lens, tables = self._decode_inputs(decode) if decode else ([], [], [], [], None)
        last = list(range(len(ids)))
        prefill_lens = []
        for s in prefill:
            toks = s.all_tokens()
            n = len(toks)
            ids.extend(toks)
            pos.extend(range(n))
            blocks = s.blocks
            slots.extend(blocks[p // bs] * bs + p % bs for p in range(n))
            last.append(len(ids) - 1)
            prefill_lens.append(n)
        decode_tables = None
        if decode:
            nb = -(-max(lens) // bs)
            decode_tables = torch.from_numpy(tables[:, :nb])
        meta = build_metadata(self.cache, slots, decode_tables, lens, prefill_lens, self.device)
        dev = self.device
        input_ids = torch.tensor(ids, dtype=torch.int64).to(dev, non_blocking=True)[None]
        position_ids = torch.tensor(pos, dtype=torch.int64).to(dev, non_blocking=True)[None]
        keep = torch.tensor(last, dtype=torch.int64).to(dev, non_blocking=True)
        out = self.model(
            input_ids=input_ids,
            position_ids=position_ids,
            use_cache=False,
            logits_to_keep=keep,
            kv_meta=meta,
        )
        return out.logits[0]

    def _process(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """Logits processors before temperature: repetition penalty and the min_tokens ban."""
        pen_rows = [i for i, s in enumerate(seqs) if s.params.repetition_penalty != 1.0]
        if pen_rows:
            rows, cols = [], []
            for i in pen_rows:
                toks = set(seqs[i].all_tokens())
                rows.extend([i] * len(toks))
                cols.extend(toks)
            seen = torch.zeros_like(logits, dtype=torch.bool)
            seen[torch.tensor(rows, device=self.device), torch.tensor(cols, device=self.device)] = True
            penalty = torch.tensor([s.params.repetition_penalty for s in seqs], device=self.device)
            logits = apply_repetition_penalty(logits, seen, penalty)
        rows, cols = [], []
        for i, s in enumerate(seqs):
            if len(s.output) < s.params.min_tokens:
                banned = [t for t in s.params.stop_ids if t < self.vocab_size]
                rows.extend([i] * len(banned))
                cols.extend(banned)
        if rows:
            logits = logits.index_put(
                (torch.tensor(rows, device=self.device), torch.tensor(cols, device=self.device)),
                torch.tensor(float("-inf"), device=self.device),
            )
        return logits

    def _sampling_batch(self, seqs: list[Sequence]) -> SamplingBatch:
        ps = [s.params for s in seqs]
        top_ks = [p.top_k for p in ps]
        top_ps = [p.top_p for p in ps]
        num_top = max((p.logprobs or 0) for p in ps)
        mask_width = max((p.top_k for p in ps if p.want_mask), default=0)
        floats = torch.tensor(
            [[p.temperature for p in ps], top_ps, [p.min_p for p in ps]], dtype=torch.float32
        ).to(self.device, non_blocking=True)
        ints = torch.tensor(
            [top_ks, [p.seed for p in ps], [len(s.output) for s in seqs]], dtype=torch.int64
        ).to(self.device, non_blocking=True)
        return SamplingBatch(
            temperature=floats[0],
            top_k=ints[0],
            top_p=floats[1],
            min_p=floats[2],
            seeds=ints[1],
            positions=ints[2],
            num_sorted=plan_columns(top_ks, top_ps, num_top, mask_width, self.vocab_size),
            num_top_logprobs=num_top,
            mask_width=mask_width,
            all_top_k=all(k > 0 for k in top_ks),
        )

    def _to_host(self, res, seqs: list[Sequence], batch: SamplingBatch) -> list[TokenOut]:
        """One device->host transfer of everything the step produced."""
        k, w = batch.num_top_logprobs, batch.mask_width
        packed = torch.cat(
            [
                res.token_ids[:, None].double(),
                res.logprobs[:, None].double(),
                res.ranks[:, None].double(),
                res.top_ids.double(),
                res.top_logprobs.double(),
                res.mask_ids.double(),
            ],
            dim=1,
        )
        arr = packed.cpu().numpy()
        tokens = arr[:, 0].astype(np.int64).tolist()
        logprobs = arr[:, 1].tolist()
        ranks = arr[:, 2].astype(np.int64).tolist()
        top_ids = arr[:, 3 : 3 + k].astype(np.int64).tolist() if k else None
        top_lps = arr[:, 3 + k : 3 + 2 * k].tolist() if k else None
        masks = arr[:, 3 + 2 * k : 3 + 2 * k + w].astype(np.int64).tolist() if w else None
        outs = []
        for i, s in enumerate(seqs):
            p = s.params
            top = None
            if p.logprobs is not None:
                n = p.logprobs
                top = (top_ids[i][:n], top_lps[i][:n]) if n else ([], [])
            mask = None
            if p.want_mask:
                mask = [x for x in masks[i] if x >= 0]
            outs.append(TokenOut(tokens[i], logprobs[i], ranks[i], top, mask))
        return outs
