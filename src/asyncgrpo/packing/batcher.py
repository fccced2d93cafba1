"""TokenBudgetBatcher: assigns samples to the rows of micro-batches (one row per process).

Pure bookkeeping (no clock, no I/O): samples go in one at a time, closed micro-batches come out.

Rules (DESIGN 5):
- a row holds at most `token_budget` unique tokens (what `pack_row` will forward: shared tokens
  counted once) and at most `max_trained_tokens` loss terms (trained tokens are never shared, so
  duplicated samples can hold more loss terms than forwarded tokens);
- a sample goes to the row that already holds its group (its prompt is there); a sample of a new
  group goes to the row where it adds the least cost;
- when the group's row is full, the sample spills to another row only if some row is still empty
  or the spill does not raise the most loaded row; otherwise the micro-batch closes and the sample
  starts the next one;
- samples longer than `token_budget` (or with more trained tokens than `max_trained_tokens`) fit
  no row: dropped with a warning, counted in `batch/dropped_oversize_count`.

Cost of a row = attended (query, key) pairs = sum over its unique tokens of (trie depth + 1), i.e.
the sum of path lengths. This is what tree attention computes, and it is exact for the trie that
`pack_row` builds: both use the same sorted-neighbour sharing rule, so `row_tokens` here equals
`pack_row(row).num_tokens` and the cost equals `pack_row(row).attention_pairs`.

Fewer samples than processes: every emitted row must be non-empty. A micro-batch closed by `add`
always has every row filled (an empty row accepts any sample). `flush()` first moves samples from
rows holding several samples into empty rows; if there are still fewer samples than processes, it
emits nothing and keeps them pending (the trainer waits for more samples; `num_pending_samples`).
"""

from __future__ import annotations

import bisect
import logging
from dataclasses import dataclass, field

from asyncgrpo import metrics as M
from asyncgrpo.packing.tree import shared_prefix_len, sort_key
from asyncgrpo.types import Sample

logger = logging.getLogger(__name__)

__all__ = [
    "MicroBatch",
    "TokenBudgetBatcher",
]


def _path_cost(shared: int, length: int) -> int:
    """Attended pairs of the tokens at depths [shared, length): sum of (depth + 1)."""
    return (length * (length + 1) - shared * (shared + 1)) // 2


@dataclass
class _Row:
    """A row being filled: its samples in sorted-key order, with the trie totals."""

    keys: list[bytes] = field(default_factory=list)
    sorted_samples: list[Sample] = field(default_factory=list)
    shared: list[int] = field(default_factory=list)  # with the sorted predecessor
    samples: list[Sample] = field(default_factory=list)  # arrival order (what is emitted)
    tokens: int = 0
    cost: int = 0
    trained: int = 0
    raw_tokens: int = 0

    def preview(self, sample: Sample, key: bytes) -> tuple[int, int, int, int, int]:
        """(position, new_tokens, new_cost, shared_with_pred, shared_of_succ) if `sample` joined."""
        pos = bisect.bisect_right(self.keys, key)
        length = sample.num_tokens
        e_new = shared_prefix_len(self.sorted_samples[pos - 1].token_ids, sample.token_ids) if pos > 0 else 0
        tokens = self.tokens + length - e_new
        cost = self.cost + _path_cost(e_new, length)
        e_succ = -1
        if pos < len(self.keys):
            succ = self.sorted_samples[pos]
            e_old, succ_len = self.shared[pos], succ.num_tokens
            e_succ = shared_prefix_len(sample.token_ids, succ.token_ids)
            tokens += e_old - e_succ
            cost += _path_cost(e_succ, succ_len) - _path_cost(e_old, succ_len)
        return pos, tokens, cost, e_new, e_succ

    def insert(self, sample: Sample, key: bytes, preview: tuple[int, int, int, int, int]) -> None:
        pos, tokens, cost, e_new, e_succ = preview
        if e_succ >= 0:
            self.shared[pos] = e_succ
        self.keys.insert(pos, key)
        self.sorted_samples.insert(pos, sample)
        self.shared.insert(pos, e_new)
        self.samples.append(sample)
        self.tokens, self.cost = tokens, cost
        self.trained += sample.num_trained
        self.raw_tokens += sample.num_tokens


@dataclass
class MicroBatch:
    """One closed micro-batch: `rows[p]` is what process p packs (`pack_row(rows[p])`)."""

    rows: list[list[Sample]]
    row_tokens: list[int]  # unique (forwarded) tokens per row
    row_raw_tokens: list[int]  # tokens before sharing
    row_trained_tokens: list[int]
    row_costs: list[int]  # attended (query, key) pairs per row
    token_budget: int
    dropped_oversize_count: int = 0  # samples dropped since the previous micro-batch

    @property
    def num_samples(self) -> int:
        return sum(len(r) for r in self.rows)

    def metrics(self) -> dict[str, float]:
        """The `batch/*` row metrics of this micro-batch (the sink applies the window rules)."""
        num_rows = len(self.rows)
        total = sum(self.row_tokens)
        longest = max(self.row_tokens)
        mean_cost = sum(self.row_costs) / num_rows
        return {
            M.BATCH_SAMPLES_PER_ROW: self.num_samples / num_rows,
            M.BATCH_ROW_TOKENS_MEAN: total / num_rows,
            M.BATCH_ROW_TOKENS_MAX: float(longest),
            M.BATCH_ROW_FILL_FRAC: total / (num_rows * self.token_budget),
            M.BATCH_ROW_IMBALANCE: max(self.row_costs) / mean_cost if mean_cost > 0 else 1.0,
            M.BATCH_PACKING_RATIO: sum(self.row_raw_tokens) / total,
            M.BATCH_PAD_FRAC: 1.0 - total / (num_rows * longest),
            M.BATCH_DROPPED_OVERSIZE_COUNT: float(self.dropped_oversize_count),
        }


class TokenBudgetBatcher:
    """Fills `num_processes` rows per micro-batch up to `token_budget` unique tokens each.

    Args:
        token_budget: most unique tokens in one row (`AsyncGRPOConfig.token_budget`).
        num_processes: rows per micro-batch (one per data-parallel process).
        max_trained_tokens: most trained tokens (loss terms) in one row; default `token_budget`.
    """

    def __init__(self, token_budget: int, num_processes: int, max_trained_tokens: int | None = None):
        if token_budget < 1:
            raise ValueError(f"token_budget must be >= 1, got {token_budget}")
        if num_processes < 1:
            raise ValueError(f"num_processes must be >= 1, got {num_processes}")
        self.token_budget = int(token_budget)
        self.num_processes = int(num_processes)
        self.max_trained_tokens = int(max_trained_tokens if max_trained_tokens is not None else token_budget)
        self.num_dropped_oversize = 0
        self._dropped_since_emit = 0
        self._rows = [_Row() for _ in range(self.num_processes)]
        self._group_row: dict[int, int] = {}

    @property
    def num_pending_samples(self) -> int:
        return sum(len(r.samples) for r in self._rows)

    @property
    def pending_samples(self) -> list[Sample]:
        """Samples assigned to the open micro-batch, not emitted yet."""
        return [s for r in self._rows for s in r.samples]

    def add(self, sample: Sample) -> list[MicroBatch]:
        """Assign one sample; returns the micro-batches this closed (zero or one)."""
        if sample.num_tokens > self.token_budget or sample.num_trained > self.max_trained_tokens:
            self.num_dropped_oversize += 1
            self._dropped_since_emit += 1
            logger.warning(
                "dropping sample of group %d (rollout %r): %d tokens, %d trained, over token_budget=%d "
                "(max trained tokens %d); raise token_budget to train such samples",
                sample.group_id, sample.rollout_id, sample.num_tokens, sample.num_trained,
                self.token_budget, self.max_trained_tokens)
            return []
        key = sort_key(sample.token_ids)
        if self._place(sample, key):
            return []
        closed = self._close()
        placed = self._place(sample, key)
        assert placed, "a sample within the budget must fit an empty micro-batch"
        return [closed]

    def flush(self) -> list[MicroBatch]:
        """Emit the open micro-batch if every process can get a non-empty row (see module doc)."""
        if self.num_pending_samples < self.num_processes:
            return []
        rows = [r.samples for r in self._rows]
        while any(not r for r in rows):
            empty = next(i for i, r in enumerate(rows) if not r)
            donor = max(range(len(rows)), key=lambda i: len(rows[i]))
            rows[empty] = [rows[donor].pop()]
        self._rows = [self._build_row(samples) for samples in rows]
        return [self._close()]

    def _build_row(self, samples: list[Sample]) -> _Row:
        row = _Row()
        for sample in samples:
            key = sort_key(sample.token_ids)
            row.insert(sample, key, row.preview(sample, key))
        return row

    def _fits(self, row: _Row, sample: Sample, preview: tuple[int, int, int, int, int]) -> bool:
        return preview[1] <= self.token_budget and row.trained + sample.num_trained <= self.max_trained_tokens

    def _place(self, sample: Sample, key: bytes) -> bool:
        previews = [row.preview(sample, key) for row in self._rows]
        fitting = [i for i, row in enumerate(self._rows) if self._fits(row, sample, previews[i])]
        home = self._group_row.get(sample.group_id)
        if home is not None and home in fitting:
            target = home
        elif home is not None:  # the group's row is full: spill or close
            empty = [i for i in fitting if not self._rows[i].samples]
            others = [i for i in fitting if i != home]
            if empty:
                target = empty[0]
            elif others:
                target = min(others, key=lambda i: previews[i][2])
                if previews[target][2] > max(row.cost for row in self._rows):
                    return False
            else:
                return False
        elif fitting:
            target = min(fitting, key=lambda i: previews[i][2])
        else:
            return False
        self._rows[target].insert(sample, key, previews[target])
        self._group_row[sample.group_id] = target
        return True

    def _close(self) -> MicroBatch:
        rows = self._rows
        assert all(r.samples for r in rows), "every emitted row must be non-empty"
        batch = MicroBatch(
            rows=[r.samples for r in rows],
            row_tokens=[r.tokens for r in rows],
            row_raw_tokens=[r.raw_tokens for r in rows],
            row_trained_tokens=[r.trained for r in rows],
            row_costs=[r.cost for r in rows],
            token_budget=self.token_budget,
            dropped_oversize_count=self._dropped_since_emit,
        )
        self._dropped_since_emit = 0
        self._rows = [_Row() for _ in range(self.num_processes)]
        self._group_row = {}
        return batch
