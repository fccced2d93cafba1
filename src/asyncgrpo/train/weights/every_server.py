"""The weight push to several inference servers: one transport per server, each chosen for its server
(`choose.make_transport`: CUDA IPC only to a server on the trainer's GPU, NCCL or gloo to the others,
LoRA adapters where the server serves them), all pushed at every sync.

    push(model, version)   ServerLinks.paused(): every live server paused at once
                             transport 0 .push -> transport 1 .push -> ...   (one after the other)
                           every live server resumed at once
                           -> timings: the whole sync, and `total_s/<i>` per server (perf/weight_sync_s/<i>)

The transports push one after the other, not at once: each full push gathers the weights again
(`gather.push_weights`), and with an FSDP2-sharded model every rank takes part in those gathers in the
same order, which concurrent pushes from threads would interleave differently on each rank; one CUDA
staging buffer serves a push at a time; and a failure stops the sync before the next server, naming
its server. The servers wait paused for the transfers to each other, so the pause grows with the number
of servers (the pause and resume themselves run at once). The other ranks (no link) hold one `OtherRank`
per server, so that their part of the gathers matches rank 0's pushes one for one.

A server that stops answering (one training process, full weights; `failover`):

    a sync cannot reach it (pause, push or resume: `ServerConnectionError`) while another server answers
      -> a WARNING names it; it is out: no sync pauses or pushes it, training goes on with the others
         (the rollout process sends its requests elsewhere: `rollout.server_load.ServerLoads.fail_over`)
    at most every REJOIN_EVERY_S, while the trainer waits for samples and before each sync: its /health
      -> answers: the transfer set up again, the current weights pushed (it alone paused), back in; the
         rollout process sends it groups again once it serves them (its /weight_info)

The last server that answers is never left out: its failure stops the run as with one server. With
several training processes the number of pushes must match on every rank, and with adapter-only LoRA
sync a server that comes back lacks the adapter versions in flight: there a server that stops answering
stops the run. Adapter-only transports replace no served weights: their servers are not paused.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence

import torch

from asyncgrpo.generation.protocol import ProtocolError
from asyncgrpo.generation.transport import ServerConnectionError, ServerRequestError
from asyncgrpo.train.server_link import ServerLinks
from asyncgrpo.train.weights.base import WeightTransport
from asyncgrpo.types import WeightVersion

logger = logging.getLogger(__name__)

PER_SERVER_TOTAL = "total_s/{index}"
"""The timing key of server `index`'s part of a sync: its pause, its push and its resume, in seconds."""
REJOIN_EVERY_S = 5.0  # how often a server that stopped answering is asked for its /health
_ADDED_UP = ("transfer_s", "bytes", "num_chunks", "num_tensors", "write_s", "load_s")  # sizes and times
_REJOIN_ERRORS = (ServerConnectionError, ServerRequestError, ProtocolError, TimeoutError, RuntimeError)


def every_server_timings(parts: Mapping[int, dict[str, float]], *, pause_s: Mapping[int, float],
                         resume_s: Mapping[int, float], total_s: float) -> dict[str, float]:
    """One sync's timings (pure; the keys of `WeightTransport.push`) from each pushed server's `parts`
    and its `pause_s` and `resume_s` (all keyed by server index; a missing pause or resume is 0): the
    pauses and resumes ran at once (their longest counts), the pushes one after the other (their times
    and sizes add up; any other value is averaged); plus `total_s/<i>`, server i's own pause + push +
    resume. {} when no part timed anything (the other ranks of a replicated model)."""
    if not any(parts.values()):
        return {}
    timings = {"total_s": total_s, "pause_s": max(pause_s.values(), default=0.0),
               "resume_s": max(resume_s.values(), default=0.0), "transfer_s": 0.0}
    others: dict[str, list[float]] = {}
    for part in parts.values():
        for key, value in part.items():
            if key in _ADDED_UP:
                timings[key] = timings.get(key, 0.0) + value
            elif key not in timings:  # a flag or a fraction a transport reports: its mean over the servers
                others.setdefault(key, []).append(value)
    timings.update({key: sum(values) / len(values) for key, values in others.items()})
    for i, part in parts.items():
        timings[PER_SERVER_TOTAL.format(index=i)] = (pause_s.get(i, 0.0) + part.get("total_s", 0.0)
                                                     + resume_s.get(i, 0.0))
    return timings


class EveryServer:
    """Pushes the trainer's weights to every server at each sync (module docstring).

    Args:
        transports: One per server, in the order of `vllm_server_base_url` (`make_transport` each).
        links: The servers' links (rank 0), which pause them together; None on the other ranks.
        failover: Leave out a server that stops answering while another answers (module docstring).
    """

    def __init__(self, transports: Sequence[WeightTransport], links: ServerLinks | None, *,
                 failover: bool = False) -> None:
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
        self.failover = failover and self.pauses
        self.out: set[int] = set()  # servers that stopped answering, left out until they answer again
        self._rejoin_checked_at = time.monotonic()

    @property
    def lora_name(self) -> str | None:
        return self.transports[0].lora_name

    def init(self) -> None:
        for transport in self.transports:
            transport.init()

    def push(self, model: torch.nn.Module, version: WeightVersion) -> dict[str, float]:
        t0 = time.perf_counter()
        if not self.pauses:
            parts = {i: transport.push(model, version) for i, transport in enumerate(self.transports)}
            return every_server_timings(parts, pause_s={}, resume_s={}, total_s=time.perf_counter() - t0)
        self._rejoin(model, version)
        live = [i for i in range(len(self.transports)) if i not in self.out]
        spare = self.failover and len(live) > 1
        parts: dict[int, dict[str, float]] = {}
        with self.links.paused(live, spare_unreachable=spare) as paused:
            lost = paused["unreachable"]
            for i in live:
                if i in lost:
                    continue
                try:
                    parts[i] = self.transports[i].push(model, version)
                except ServerConnectionError as exc:
                    if not spare or len(lost) + 1 >= len(live):  # the last server that answers
                        raise
                    lost[i] = exc
        for i, exc in paused["unreachable"].items():
            parts.pop(i, None)
            self._leave_out(i, exc)
        return every_server_timings(parts, pause_s=paused["pause_s"], resume_s=paused["resume_s"],
                                    total_s=time.perf_counter() - t0)

    def idle(self, model: torch.nn.Module, version: WeightVersion) -> None:
        for i, transport in enumerate(self.transports):
            if i not in self.out:  # an out server's restart check would wait out its retries
                transport.idle(model, version)
        if self.out and time.monotonic() - self._rejoin_checked_at >= REJOIN_EVERY_S:
            self._rejoin(model, version)

    def _leave_out(self, index: int, exc: BaseException) -> None:
        self.out.add(index)
        live = len(self.transports) - len(self.out)
        logger.warning(
            "the inference server at %s does not answer (%s): training goes on with the other %d server(s), "
            "without it; it gets the weights and rollouts again once its /health answers",
            self.links.links[index].base_url, _first_sentence(exc), live,
        )

    def _rejoin(self, model: torch.nn.Module, version: WeightVersion) -> None:
        """Each out server whose /health answers gets the weight transfer set up again and the weights
        `version` (it alone paused), and is back in."""
        self._rejoin_checked_at = time.monotonic()
        for i in sorted(self.out):
            link, transport = self.links.links[i], self.transports[i]
            if not link.answers():
                continue
            try:
                transport.close()  # its end of the old transfer: the server lost it, or keeps one to replace
                transport.init()
                transport.push(model, version)
            except _REJOIN_ERRORS as exc:
                logger.warning("the inference server at %s answers again but could not take the weights yet "
                               "(%s); trying again in %.0f s", link.base_url, _first_sentence(exc),
                               REJOIN_EVERY_S)
                continue
            self.out.discard(i)
            logger.warning("the inference server at %s answers again and serves the trainer's weights (%s): "
                           "it takes rollouts again", link.base_url, WeightVersion(version).label())

    def close(self) -> None:
        """Close every transport (each even when another fails); the first failure is raised."""
        failure: BaseException | None = None
        for i, transport in enumerate(self.transports):
            try:
                transport.close()
            except Exception as exc:  # noqa: BLE001 -- close them all, then raise the first
                if i not in self.out:  # a server that stopped answering cannot be told
                    failure = failure or exc
        if failure is not None:
            raise failure

    def __str__(self) -> str:
        return f"EveryServer({', '.join(str(t) for t in self.transports)})"


def _first_sentence(exc: BaseException) -> str:
    """What failed, without the advice of a single-server run ("resume training from ...")."""
    return str(exc).split(". ")[0]
