"""The generation engine: a thread that owns the scheduler and the model runner.

    HTTP handlers (asyncio loop)                    engine thread
    ---------------------------                     -------------
    submit(seqs, sink) ----- command queue ----->   waiting queue
    pause/resume/abort/call -------------------->   applied between two steps
                                                    schedule -> launch -> (previous step) record
    sink(events) <--- loop.call_soon_threadsafe --- one delivery per step (streamed tokens,
                                                    finished sequences)

Only the engine thread touches sequences' mutable state while they run; a sink receives
(sequence, first_new_index, end_index, finished) tuples after the lists were extended, so the loop
side may read `output[first:end]` safely. Pause modes follow vLLM 0.33 (protocol section 5.3):
keep freezes everything (new requests queue), abort ends in-flight requests with `abort`, wait
drains running work before the pause completes. `call(fn)` runs fn in the engine thread between
steps (weight loading), so the model never changes under a forward pass.

Asynchronous scheduling (`async_scheduling`, on by default on CUDA, as vLLM's `--async-scheduling`):
the thread plans and launches step N + 1 before it waits for step N's tokens, so its host work
(planning, building inputs, recording tokens, handing them out) runs while the device computes
instead of between two device steps:

    synchronous    plan N | launch N | wait N | record N | plan N+1 | launch N+1 | wait N+1 ...
    asynchronous   plan N+1 | launch N+1 | wait N | record N | plan N+2 | launch N+2 | wait N+1 ...

Step N + 1 reads the tokens step N sampled on the device (`Sequence.pending`, see scheduler.py).
What it costs: a sequence that step N ends with a stop token was launched in step N + 1 too, whose
token for it is dropped (one wasted row); sequences that end by length are known to end at launch
and are not planned again. A step whose logits processing needs the ids on the host (repetition
penalty) and every command but `add` first record the step in flight.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any, Protocol

import torch

from asyncgrpo.server.metrics import EngineStats, StepRecord
from asyncgrpo.server.runner import ModelRunner
from asyncgrpo.server.scheduler import Scheduler
from asyncgrpo.server.sequence import Sequence
from asyncgrpo.server.step_output import LaunchedStep

logger = logging.getLogger(__name__)

Event = tuple[Sequence, int, int, bool]


class Sink(Protocol):
    """Loop-side receiver of a request's events (called in the asyncio loop, one call per step)."""

    stream: bool  # every step's new tokens; False: only the final event of each sequence

    def __call__(self, events: list[Event]) -> None: ...


class Engine:
    """The engine thread over a runner and a scheduler (`build.build_engine` assembles them), handed to the
    HTTP side, which drives it with the loop-side API below."""

    def __init__(self, runner: ModelRunner, scheduler: Scheduler, async_scheduling: bool = False) -> None:
        self.runner = runner
        self.scheduler = scheduler
        self.loop: asyncio.AbstractEventLoop | None = None  # the HTTP side's, from `start`
        self.stats = EngineStats()
        self.weight_version = "default"
        self.pause_mode: str | None = None  # None, "keep", "abort", "wait"
        self._on_update: Callable[[Engine], None] | None = None
        self._commands: queue.Queue = queue.Queue()
        self._wait_futures: list[asyncio.Future] = []
        self._clear_after_wait = False  # pause(wait, clear_cache=True): reset the prefix cache once drained
        self._thread = threading.Thread(target=self._run, name="asyncgrpo-engine", daemon=True)
        self._stopping = False
        self.dead: str | None = None  # traceback text once the thread died
        # plan and launch step N + 1 before recording step N (CUDA: the host's work overlaps the device's)
        self.async_scheduling = async_scheduling
        self._in_flight: tuple[LaunchedStep, list[Sequence]] | None = None  # launched, not recorded
        self._stream = None

    # ---- loop-side API (call from the asyncio loop) -------------------------------------------
    def start(self, loop: asyncio.AbstractEventLoop, on_update: Callable[[Engine], None] | None = None,
              stream=None) -> None:
        """Start the engine thread, delivering to `loop`; `on_update(engine)` after every change of what
        runs (metrics); stream: a CUDA stream the thread runs its steps on (a server inside a trainer's
        process, whose kernels may then run beside the trainer's); None: the default stream."""
        self.loop, self._on_update, self._stream = loop, on_update, stream
        self._thread.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        self._commands.put(("stop",))
        self._thread.join(timeout_s)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.dead is None

    def submit(self, seqs: list[Sequence], sink: Sink) -> None:
        for s in seqs:
            s.sink = sink
        self._commands.put(("add", seqs))

    def _future(self) -> asyncio.Future:
        return self.loop.create_future()

    async def abort(self, request_keys: list[str] | None) -> int:
        """Abort the sequences of these engine request ids (all when None); returns #requests."""
        fut = self._future()
        self._commands.put(("abort", None if request_keys is None else set(request_keys), fut))
        return await fut

    def abort_nowait(self, request_keys: list[str]) -> None:
        self._commands.put(("abort", set(request_keys), None))

    async def pause(self, mode: str, clear_cache: bool) -> None:
        fut = self._future()
        self._commands.put(("pause", mode, clear_cache, fut))
        await fut

    async def resume(self) -> None:
        fut = self._future()
        self._commands.put(("resume", fut))
        await fut

    async def call(self, fn: Callable[[], Any]) -> Any:
        """Run fn() in the engine thread between two steps; its exception propagates here."""
        fut = self._future()
        self._commands.put(("call", fn, fut))
        return await fut

    async def set_weight_version(self, version: str) -> None:
        """Label the served weights (tokens sampled after this carry it), between two steps."""

        def apply() -> None:
            self.weight_version = version

        await self.call(apply)

    # ---- engine thread ------------------------------------------------------------------------
    def _resolve(self, fut: asyncio.Future | None, value: Any = None, error: BaseException | None = None):
        if fut is None:
            return

        def done() -> None:
            if fut.done():
                return
            if error is not None:
                fut.set_exception(error)
            else:
                fut.set_result(value)

        self.loop.call_soon_threadsafe(done)

    def _deliver(self, events: list[Event]) -> None:
        if not events:
            return
        by_sink: dict[int, tuple[Sink, list[Event]]] = {}
        for ev in events:
            sink = ev[0].sink
            by_sink.setdefault(id(sink), (sink, []))[1].append(ev)

        def dispatch() -> None:
            for sink, evs in by_sink.values():
                sink(evs)

        self.loop.call_soon_threadsafe(dispatch)

    def _frozen(self) -> bool:
        return self.pause_mode in ("keep", "abort")

    def _run(self) -> None:
        try:
            if self._stream is not None:  # (the current stream is per thread) after the start-up work
                self._stream.wait_stream(torch.cuda.default_stream(self._stream.device))
                torch.cuda.set_stream(self._stream)
            while not self._stopping:
                if self.pause_mode == "wait" and not self.scheduler.has_work():
                    if self._wait_futures and self._clear_after_wait:
                        self.scheduler.pool.reset()
                    for fut in self._wait_futures:
                        self._resolve(fut)
                    self._wait_futures.clear()
                # with nothing to run, sleep until a command arrives (no polling)
                idle = self._frozen() or not self.scheduler.has_work()
                for cmd in self._next_commands(block=idle):
                    self._handle(cmd)
                if not self._stopping and not self._frozen() and self.scheduler.has_work():
                    self._step()
        except BaseException:
            self.dead = traceback.format_exc()
            logger.error("engine thread died:\n%s", self.dead)
            self._fail_all("engine thread died; see the server log")
            raise

    def _next_commands(self, block: bool) -> list[tuple]:
        """Every queued command; when block, wait for the first one."""
        commands = []
        try:
            commands.append(self._commands.get(block=block))
            while True:
                commands.append(self._commands.get_nowait())
        except queue.Empty:
            pass
        return commands

    def _handle(self, cmd: tuple) -> None:
        kind = cmd[0]
        if kind != "add":  # every other command sees (and may change) sequences and weights at rest
            self._drain()
        if kind == "add":
            for s in cmd[1]:
                self.scheduler.add(s)
            self._notify()
        elif kind == "abort":
            keys, fut = cmd[1], cmd[2]
            self._resolve(fut, self._abort(keys))
        elif kind == "pause":
            _, mode, clear_cache, fut = cmd
            self._pause(mode, clear_cache, fut)
        elif kind == "resume":
            self.pause_mode = None
            self._resolve(cmd[1])
        elif kind == "call":
            _, fn, fut = cmd
            try:
                self._resolve(fut, fn())
            except Exception as exc:  # noqa: BLE001 -- handed to the awaiting handler
                self._resolve(fut, error=exc)
        elif kind == "stop":
            self._stopping = True
            self._fail_all("server shutting down")

    def _pause(self, mode: str, clear_cache: bool, fut: asyncio.Future) -> None:
        self.pause_mode = mode
        if mode == "abort":
            self._abort(None)
        elif mode == "keep" and clear_cache:
            seqs = self.scheduler.preempt_all()
            self.stats.num_preemptions += len(seqs)
        if mode == "wait" and self.scheduler.has_work():
            self._clear_after_wait = clear_cache  # the prefix cache is reset once drained (see _run)
            self._wait_futures.append(fut)
        else:
            if clear_cache:  # as vLLM: a paused server with clear_cache keeps no cached prefix
                self.scheduler.pool.reset()
            self._resolve(fut)
        self._notify()

    def _abort(self, keys: set[str] | None) -> int:
        hit: set[str] = set()
        events = []
        for seq in list(self.scheduler.running) + list(self.scheduler.waiting):
            if keys is None or seq.request_key in keys:
                self.scheduler.remove(seq)
                seq.finish_reason = "abort"
                hit.add(seq.request_key)
                events.append((seq, len(seq.output), len(seq.output), True))
        self._deliver(events)
        self._notify()
        return len(hit)

    def _fail_all(self, message: str) -> None:
        events = []
        for seq in list(self.scheduler.running) + list(self.scheduler.waiting):
            self.scheduler.remove(seq)
            seq.error = message
            events.append((seq, len(seq.output), len(seq.output), True))
        self._deliver(events)

    def _notify(self) -> None:
        if self._on_update is not None:
            self._on_update(self)

    def _step(self) -> None:
        start = time.perf_counter()
        try:
            self._run_step()
        finally:
            self.stats.step_s += time.perf_counter() - start

    def _run_step(self) -> None:
        start = time.perf_counter()
        if self._in_flight is not None and self.runner.needs_known_tokens(self.scheduler.running):
            self._drain()  # before planning: what the step in flight ends must not be planned again
        plan = self.scheduler.schedule()
        self.stats.num_preemptions += len(plan.preempted)
        planned = time.perf_counter()
        self.stats.schedule_s += planned - start
        if plan.size == 0:  # what runs ends with the step in flight (or waits for blocks)
            self._drain()
            self._notify()
            return
        seqs = plan.sampled
        prompt_tokens = sum(len(s.prompt) for s in seqs if not s.output and not s.pending)
        captures = self._captures()
        try:
            launched = self.runner.launch(plan.decode, plan.prefill)
        except Exception:  # noqa: BLE001 -- the failed sequences get a 500, the engine goes on
            self._drain()
            self._fail_step(plan.decode + plan.prefill, traceback.format_exc())
            return
        ran = time.perf_counter()
        self.stats.forward_s += ran - planned
        self.stats.num_steps += 1
        self.stats.num_prefill_steps += bool(plan.prefill)
        self.stats.max_batch_seqs = max(self.stats.max_batch_seqs, plan.size)
        self.stats.prompt_tokens += prompt_tokens
        previous, self._in_flight = self._in_flight, (launched, seqs)
        waited = self.runner.wait_s
        if previous is not None:
            self._finish(*previous)
        if not self.async_scheduling:
            self._drain()
        self.stats.recent.append(StepRecord(
            start=start, decode=len(plan.decode), kv_tokens=self.runner.kv_tokens,
            prefill_tokens=sum(s.prefill_end - s.prefill_start for s in plan.prefill),
            schedule_ms=(planned - start) * 1e3, forward_ms=(ran - planned) * 1e3,
            record_ms=(time.perf_counter() - ran) * 1e3, wait_ms=(self.runner.wait_s - waited) * 1e3,
            captured=self._captures() > captures))

    def _captures(self) -> int:
        return 0 if self.runner.graphs is None else self.runner.graphs.num_captures

    def _drain(self) -> None:
        """Record the step in flight, if any."""
        if self._in_flight is not None:
            step, self._in_flight = self._in_flight, None
            self._finish(*step)

    def _finish(self, launched: LaunchedStep, seqs: list[Sequence]) -> None:
        """Wait for a launched step's tokens, record them and hand them to the HTTP side."""
        start = time.perf_counter()
        try:
            out = launched.result()
        except Exception:  # noqa: BLE001 -- an error of the device surfaces at the copy
            self._fail_step(seqs, traceback.format_exc())
            return
        recorded = out.record(seqs, self.weight_version)
        self.stats.generation_tokens += len(recorded)
        events = []
        for seq in recorded:
            finished = seq.finished
            if finished:
                self.scheduler.remove(seq)
            else:
                self.scheduler.recorded(seq)
            if finished or seq.sink.stream:  # a non-streaming request only needs its final event
                end = len(seq.output)
                events.append((seq, end - 1, end, finished))
        self._deliver(events)
        self._notify()
        self.stats.record_s += time.perf_counter() - start

    def _fail_step(self, seqs: list[Sequence], trace: str) -> None:
        logger.error("a step failed on the device; failing its %d sequences:\n%s", len(seqs), trace)
        # blocks registered for this step may hold partial KV: nobody may find them again
        self.scheduler.invalidate_prefix_cache()
        events = []
        for seq in seqs:
            if seq.finished:
                continue
            self.scheduler.remove(seq)
            seq.error = "internal error in the forward pass; see the server log"
            events.append((seq, len(seq.output), len(seq.output), True))
        self._deliver(events)


def warm_up(runner: ModelRunner, scheduler: Scheduler, num_tokens: int = 3) -> None:
    """Run a short request through prefill and decode before serving (first-call kernel set-up)."""
    from asyncgrpo.server.sequence import SeqParams

    params = SeqParams(
        temperature=1.0, top_k=2, top_p=0.9, min_p=0.0, seed=0, max_tokens=num_tokens, min_tokens=0,
        stop_token_ids=frozenset(), eos_token_id=None, extra_eos_ids=frozenset(), logprobs=2, want_mask=True,
    )
    seq = Sequence(-1, "warm-up", 0, [0, 1, 2, 3], params, max_model_len=1 << 30)
    scheduler.add(seq)
    try:
        while not seq.finished:
            plan = scheduler.schedule()
            runner.step(plan.decode, plan.prefill).record(plan.sampled, "warm-up")
    finally:
        scheduler.remove(seq)
