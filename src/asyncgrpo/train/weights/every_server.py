"""The weight push to several inference servers: one transport per server, each chosen for its server
(`choose.make_transport`: CUDA IPC only to a server on the trainer's GPU, NCCL or gloo to the others,
LoRA adapters where the server serves them), all pushed at every sync.

    push(model, version)   ServerLinks.paused(): every server paused at once
                             transport 0 .push -> transport 1 .push -> ...   (one after the other)
                           every server resumed at once
                           -> timings: the whole sync, and `total_s/<i>` per server (perf/weight_sync_s/<i>)

The transports push one after the other, not at once: each full push gathers the weights again
(`gather.push_weights`), and with an FSDP2-sharded model every rank takes part in those gathers in the
same order, which concurrent pushes from threads would interleave differently on each rank; one CUDA
staging buffer serves a push at a time; and a failure stops the sync before the next server, naming
its server. The servers wait paused for the transfers to each other, so the pause grows with the number
of servers (the pause and resume themselves run at once). The other ranks (no link) hold one `OtherRank`
per server, so that their part of the gathers matches rank 0's pushes one for one.

Adapter-only LoRA transports replace no served weights: their servers are not paused, as with one server.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from asyncgrpo.train.server_link import ServerLinks
from asyncgrpo.train.weights.base import WeightTransport
from asyncgrpo.types import WeightVersion

PER_SERVER_TOTAL = "total_s/{index}"
"""The timing key of server `index`'s part of a sync: its pause, its push and its resume, in seconds."""


def every_server_timings(parts: Sequence[dict[str, float]], *, pause_s: Sequence[float],
                         resume_s: Sequence[float], total_s: float) -> dict[str, float]:
    """One sync's timings (pure; the keys of `WeightTransport.push`) from each server's push `parts` and
    each server's `pause_s` and `resume_s` (0 where the group did not pause it): the pauses and resumes
    ran at once (their longest counts), the pushes one after the other (their times and sizes add up);
    plus `total_s/<i>`, server i's own pause + push + resume. {} when no part timed anything (the other
    ranks of a replicated model)."""
    if not any(parts):
        return {}
    timings = {"total_s": total_s, "pause_s": max(pause_s), "resume_s": max(resume_s), "transfer_s": 0.0}
    for part in parts:
        for key, value in part.items():
            if key not in ("total_s", "pause_s", "resume_s"):  # transfer_s, bytes, num_chunks, write_s, ...
                timings[key] = timings.get(key, 0.0) + value
    for i, part in enumerate(parts):
        timings[PER_SERVER_TOTAL.format(index=i)] = pause_s[i] + part.get("total_s", 0.0) + resume_s[i]
    return timings


class EveryServer:
    """Pushes the trainer's weights to every server at each sync (module docstring).

    Args:
        transports: One per server, in the order of `vllm_server_base_url` (`make_transport` each).
        links: The servers' links (rank 0), which pause them together; None on the other ranks.
    """

    def __init__(self, transports: Sequence[WeightTransport], links: ServerLinks | None) -> None:
        assert transports, "one transport per server"
        if len({t.lora_name for t in transports}) > 1:  # rollouts would ask some servers for a missing model
            kinds = ", ".join(f"{'full weights' if t.lora_name is None else 'LoRA adapters'} to server {i}"
                              for i, t in enumerate(transports))
            raise ValueError(f"the servers take this run's weights differently ({kinds}): start every server "
                             "with the same LoRA settings (--enable-lora and its limits, or none)")
        self.transports = list(transports)
        self.links = links
        # full weights replace the served model's: pause every server; LoRA adapters pause none
        self.pauses = links is not None and self.lora_name is None

    @property
    def lora_name(self) -> str | None:
        return self.transports[0].lora_name

    def init(self) -> None:
        for transport in self.transports:
            transport.init()

    def push(self, model: torch.nn.Module, version: WeightVersion) -> dict[str, float]:
        t0 = time.perf_counter()
        if self.pauses:
            with self.links.paused() as paused:
                parts = [transport.push(model, version) for transport in self.transports]
        else:
            parts = [transport.push(model, version) for transport in self.transports]
            paused = {"pause_s": [0.0] * len(parts), "resume_s": [0.0] * len(parts)}
        return every_server_timings(parts, pause_s=paused["pause_s"], resume_s=paused["resume_s"],
                                    total_s=time.perf_counter() - t0)

    def idle(self, model: torch.nn.Module, version: WeightVersion) -> None:
        for transport in self.transports:
            transport.idle(model, version)

    def close(self) -> None:
        """Close every transport (each even when another fails); the first failure is raised."""
        failure: BaseException | None = None
        for transport in self.transports:
            try:
                transport.close()
            except Exception as exc:  # noqa: BLE001 -- close them all, then raise the first
                failure = failure or exc
        if failure is not None:
            raise failure

    def __str__(self) -> str:
        return f"EveryServer({', '.join(str(t) for t in self.transports)})"
