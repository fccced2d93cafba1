"""What a step sampled, on its way from the device to the host and into its sequences.

A launched step's packed output (`sampling.pack`: one [B, columns] tensor) is copied to pinned host
memory without waiting for the device; `LaunchedStep.result` waits for that copy, the host's only
wait for the device in a step, and `StepOutput.record` appends each row to its sequence.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from asyncgrpo.server.sampling import SamplingPlan
from asyncgrpo.server.sequence import Sequence


@dataclass
class StepOutput:
    """Host copy of what one step sampled; entry i belongs to the step's i-th sequence."""

    token_ids: list[int]
    logprobs: list[float]
    ranks: list[int]
    top_ids: list[list[int]] | None  # [B][K], K = the largest `logprobs` of the step
    top_logprobs: list[list[float]] | None
    candidate_ids: list[list[int]] | None  # [B][W] candidate ids ascending, padded with -1

    @classmethod
    def unpack(cls, arr: np.ndarray, k: int, w: int) -> StepOutput:
        """From the host copy of `sampling.pack`'s [B, 3 + 2k + w] array."""
        return cls(
            token_ids=arr[:, 0].astype(np.int64).tolist(),
            logprobs=arr[:, 1].tolist(),
            ranks=arr[:, 2].astype(np.int64).tolist(),
            top_ids=arr[:, 3 : 3 + k].astype(np.int64).tolist() if k else None,
            top_logprobs=arr[:, 3 + k : 3 + 2 * k].tolist() if k else None,
            candidate_ids=arr[:, 3 + 2 * k : 3 + 2 * k + w].astype(np.int64).tolist() if w else None,
        )

    def record(self, seqs: list[Sequence], version: str) -> list[Sequence]:
        """Append entry i to seqs[i] (token, log-prob, rank, top list, candidate set); the stop rules
        of `Sequence.append` apply. A sequence that finished since the step was launched (a stop token
        recorded from the step before, an abort) drops its entry. Returns the sequences appended to."""
        appended = []
        for i, seq in enumerate(seqs):
            if seq.finished:
                continue
            appended.append(seq)
            seq.append(self.token_ids[i], self.logprobs[i], self.ranks[i], version)
            k = seq.params.logprobs
            if k:
                seq.top_ids.extend(self.top_ids[i][:k])
                seq.top_logprobs.extend(self.top_logprobs[i][:k])
            if seq.params.want_mask:
                seq.masks.append([t for t in self.candidate_ids[i] if t >= 0])
        return appended


class LaunchedStep:
    """A step queued on the device; `result` waits for its outputs and reports the wait (`on_wait`)."""

    def __init__(self, host: torch.Tensor | None, done: torch.cuda.Event | None, num_top_logprobs: int,
                 mask_width: int, on_wait: Callable[[float], None] | None = None) -> None:
        self._host = host  # the packed output ([B, columns]); None: the step sampled nothing
        self._done = done
        self._shape = (num_top_logprobs, mask_width)
        self._on_wait = on_wait

    @classmethod
    def queue(cls, packed: torch.Tensor, plan: SamplingPlan,
              on_wait: Callable[[float], None]) -> LaunchedStep:
        """Queue the device->host copy of a step's packed output (into pinned memory on CUDA, so that
        queueing it does not wait for the device)."""
        if packed.device.type != "cuda":
            return cls(packed, None, plan.num_top_logprobs, plan.mask_width, on_wait)
        host = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True)
        host.copy_(packed, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        return cls(host, done, plan.num_top_logprobs, plan.mask_width, on_wait)

    def result(self) -> StepOutput:
        if self._host is None:
            return StepOutput([], [], [], None, None, None)
        start = time.perf_counter()
        if self._done is not None:
            self._done.synchronize()
        host = self._host.numpy()
        if self._on_wait is not None:
            self._on_wait(time.perf_counter() - start)
        return StepOutput.unpack(host, *self._shape)
