"""`AsyncRolloutLoop`: the asyncio side of the rollout process (constructed inside the spawned child).

    prompts --filter_prompt--> dispatcher --admit (3 limits)--> group task: num_generations x rollout
                                   ^                                 | generate_one -> generate_one_turn
                                   | slot freed / allowance moved    v
                              heartbeat (1 s)                  score queue (bounded: score_block_s)
                              server poller (/metrics, 5 s)          |
                              run(): stop_event, task failures       v
                                                              scorer: rewards -> compute_advantages
                                                                -> drop zero-std -> Samples
                                                                -> channel.samples (+ GroupFinished)

| task        | waits on                                        | unblocked by                        |
|-------------|-------------------------------------------------|-------------------------------------|
| dispatcher  | staleness (queued + in-flight tokens vs the     | trainer consuming (consumed_tokens, |
|             | trainer's token_allowance), first group, the    | token_allowance), rollouts ending,  |
|             | KV cap and max_concurrent_rollouts (per rollout)| the server poller moving the cap    |
| group task  | the inference server; a full score queue        | the scorer                          |
| scorer      | the score queue                                 | group tasks                         |

When the dispatcher is blocked with no group in flight or being scored, only the trainer can unblock
it: it puts a `RolloutIdle` on channel.samples (once per trainer view it is blocked against, and once
at the end of the prompts) so the trainer closes its partial micro-batch at once instead of waiting.

The dispatcher wakes when a rollout or group of this process finishes and polls the values the trainer
writes (shared memory, no notification) every POLL_S; every other wait polls with a short timeout too,
so a stop request or a failed task is seen within a fraction of a second. Any exception in any task
stops the loop: `run()` cancels the others, runs `close()` and re-raises (the process shell reports it
to the trainer).
"""

from __future__ import annotations

import asyncio
import contextvars
import itertools
import logging
import math
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from asyncgrpo import metrics as M
from asyncgrpo.data.prompts import PromptItem, iter_prompts
from asyncgrpo.generation.client import GenerationClient, ServerRequestError
from asyncgrpo.packing.tree import Sample
from asyncgrpo.rollout import advantages as adv
from asyncgrpo.rollout.channel import (
    IDLE_ON_POLICY,
    IDLE_OUT_OF_PROMPTS,
    IDLE_STALENESS,
    GroupFinished,
    QueuedSample,
    RolloutIdle,
    TrainerView,
)
from asyncgrpo.rollout.concurrency import ConcurrencyCap, may_start_group
from asyncgrpo.rollout.dropped_groups import DroppedGroupsWatch
from asyncgrpo.rollout.generate import (
    EnvironmentPool,
    generation_records,
    request_seed,
    run_in_environment,
    run_tool_loop,
    sampling_params,
)
from asyncgrpo.rollout.reconcile import reconcile_turns
from asyncgrpo.rollout.rewards import reward_func_names, score_group
from asyncgrpo.train.staleness import oldest_fresh_version
from asyncgrpo.types import Rollout, RolloutGroup, TurnRecord

logger = logging.getLogger(__name__)

POLL_S = 0.05
HEARTBEAT_S = 1.0
SERVER_POLL_S = 5.0


@dataclass
class _RolloutContext:
    """Per-rollout state that `generate_one_turn` reads without changing the hook's signature."""

    position: int
    rollout_index: int
    model_version: int
    num_turns: int = 0


_CURRENT_ROLLOUT: contextvars.ContextVar[_RolloutContext | None] = contextvars.ContextVar(
    "asyncgrpo_current_rollout", default=None
)


@dataclass(frozen=True)
class _Started:
    """What a group counted toward the on-policy step's worth when it was dispatched."""

    policy_version: int | None
    tokens: float


@dataclass
class _Pending:
    """A generated group waiting in the score queue."""

    group: RolloutGroup
    rollouts: list[Rollout]
    position: int
    num_tokens: int
    started: _Started


class AsyncRolloutLoop:
    """Generates and scores rollouts for `AsyncGRPOTrainer`, in the spawned rollout process.

    The default implements GRPO. Subclass it (at module level: it is pickled by reference), override
    only the hooks that change and set the subclass as the trainer's `loop_cls`. Each prompt goes
    through `filter_prompt` -> `generate_one` (which calls `generate_one_turn` per sampling request)
    -> the group's rewards (reward_funcs + environments' `get_reward` + `Rollout.reward`) ->
    `compute_advantages`. `setup()` / `close()` run on the loop's event loop. Hooks may read
    `self.config` and `self.tokenizer`.
    """

    def __init__(
        self,
        config: Any,
        model_name: str,
        dataset: Any,
        reward_funcs: list[Callable] | None,
        processing_class: Any,
        eos_token_ids: list[int],
        channel: Any,
        tools: list[Callable] | None = None,
        environment_factory: Callable[[], Any] | dict[str, Callable[[], Any]] | None = None,
        score_queue_maxsize: int = 16,
        lora_name: str | None = None,
        dataset_start_index: int = 0,
        dataset_skip_positions: Sequence[int] = (),
    ) -> None:
        if dataset is None and environment_factory is None:
            raise ValueError("dataset is None: pass a train_dataset, or an environment_factory whose reset() returns the prompt")
        self.config = config
        self.model_name = model_name
        self.dataset = dataset
        self.reward_funcs = list(reward_funcs or [])
        self.tokenizer = processing_class
        self.processing_class = processing_class
        self.eos_token_ids = [int(t) for t in eos_token_ids]
        self.channel = channel
        self.tools = list(tools or [])
        self.environment_factory = environment_factory
        self.score_queue_maxsize = score_queue_maxsize
        self.lora_name = lora_name
        self.dataset_start_index = dataset_start_index
        self.dataset_skip_positions = frozenset(dataset_skip_positions)  # trained before a resume
        self.num_generations = int(config.num_generations)
        self.max_concurrent_rollouts = int(config.max_concurrent_rollouts)
        self._environments = EnvironmentPool.from_argument(environment_factory)
        self._has_tools = bool(self.tools) or self._environments is not None
        # runtime state, created in run() on the loop's own event loop
        self._executor: ThreadPoolExecutor | None = None
        self._client: Any = None
        self._server_info: Any = None
        self._server_lock: asyncio.Lock | None = None
        self._score_queue: asyncio.Queue[_Pending] | None = None
        self._failure: asyncio.Future | None = None
        self._tasks: set[asyncio.Task] = set()  # every task the loop started and that is not done
        self._in_flight = 0  # rollouts started and not finished
        self._pending_tokens = 0  # tokens of generated groups not yet queued (or dropped)
        self._produced_tokens = 0  # tokens of every sample put on channel.samples
        self._tokens_per_rollout: float | None = None  # running estimate, known once a group finished
        self._num_groups_generating = 0
        self._groups_generated = 0
        self._groups_open = 0  # groups dispatched whose GroupFinished is not on channel.samples yet
        self._idle_sent: RolloutIdle | None = None  # the RolloutIdle sent since the last group started
        self._progressed: asyncio.Event | None = None  # set when a rollout or group finishes (dispatcher wakes)
        # max_staleness=0 (strictly on-policy): tokens started under the current weight version
        self._policy_version: int | None = None
        # epoch-based runs (max_steps <= 0) end after num_train_epochs passes over the dataset
        self._last_position = _last_position(config, dataset)
        self._tokens_started_at_version = 0.0
        self._reward_names = reward_func_names(self.reward_funcs)
        self._dropped_watch = DroppedGroupsWatch()
        self._kv_cap: ConcurrencyCap | None = None
        self._warned_candidates = False
        self._next_group_id = 0
        self._rate_mark = time.perf_counter()  # start of the span the next generated-tokens rate covers
        self._request_counter = 0

    # -- hooks ------------------------------------------------------------------------------------

    def filter_prompt(self, row_index: int, row: dict[str, Any], epoch: int) -> bool:
        """Whether to generate for a prompt at all. Default: every prompt."""
        return True

    async def setup(self) -> None:
        """Create what the other hooks need (e.g. an HTTP client), on the loop's event loop."""

    async def close(self) -> None:
        """Release what `setup()` created. Runs when the loops stop, failures included."""

    def compute_advantages(self, group: RolloutGroup) -> np.ndarray:
        """One advantage per rollout: rewards standardised within the group, 0 for NaN rewards."""
        return adv.compute_advantages(group.rewards)

    async def generate_one(self, prompt: list[dict[str, Any]], tools: list[Callable], group_id: int = 0) -> Rollout:
        """One rollout: the multi-turn tool loop (one turn when there are no tools)."""
        return await run_tool_loop(
            prompt,
            tools,
            generate_turn=self.generate_one_turn,
            tokenizer=self.tokenizer,
            eos_token_ids=self.eos_token_ids,
            chat_template_kwargs=dict(getattr(self.config, "chat_template_kwargs", None) or {}),
            max_iterations=getattr(self.config, "max_tool_calling_iterations", None),
            executor=self._executor,
            record=self.channel.metrics.put,
            tool_timeout_s=self.config.tool_call_timeout,
        )

    async def generate_one_turn(self, prompt_ids: list[int]) -> TurnRecord:
        """One sampling request with the config's sampling settings and a unique seed."""
        client, info = await self._server()
        config = self.config
        context = _CURRENT_ROLLOUT.get()
        if context is not None:
            seed = request_seed(int(config.seed), context.position, context.rollout_index, context.num_turns)
            context.num_turns += 1
        else:  # called outside a rollout (e.g. by a custom hook): still never repeat a seed
            self._request_counter += 1
            seed = request_seed(int(config.seed), -1, self._request_counter, 0)
        params = sampling_params(
            config, seed=seed, eos_token_ids=self.eos_token_ids, return_sampling_mask=self._wants_candidates(info)
        )
        try:
            out = await client.generate(list(prompt_ids), params, **self._model_kwargs(context))
        except ServerRequestError as exc:  # LoRA hook: the adapter was retired between naming and serving it
            if exc.status != 404 or not self.lora_name:
                raise
            out = await client.generate(list(prompt_ids), params, **self._model_kwargs(context))
        return TurnRecord(
            prompt_ids=list(prompt_ids),
            output_ids=list(out.token_ids),
            output_log_probs=list(out.logprobs or []),
            output_sampling_mask=out.sampling_mask if params.return_sampling_mask else None,
            output_sampler_logprobs=out.top_logprobs if params.logprobs else None,
        )

    # -- run --------------------------------------------------------------------------------------

    async def run(self, on_failure: Callable[[BaseException], None] | None = None) -> None:
        """Run until `channel.stop_event` is set (returns) or any task fails (raises).

        `on_failure(exc)` is called as soon as a task fails, before the other tasks are cancelled and
        `close()` runs, so the trainer hears about it without waiting for the shutdown.
        """
        loop = asyncio.get_running_loop()
        self._failure = loop.create_future()
        self._server_lock = asyncio.Lock()
        self._score_queue = asyncio.Queue(maxsize=self.score_queue_maxsize)
        self._progressed = asyncio.Event()
        self._executor = ThreadPoolExecutor(self.max_concurrent_rollouts, thread_name_prefix="asyncgrpo-tool")
        self._rate_mark = time.perf_counter()
        self._spawn(self._heartbeat(), "heartbeat")
        setup = self._spawn(self.setup(), "setup")
        try:
            await self._until_stopped_or_failed(setup)
            if self.channel.stop_event.is_set():
                return
            setup.result()  # raises what setup() raised
            self._spawn(self._dispatch(), "dispatcher")
            self._spawn(self._score_forever(), "scorer")
            await self._until_stopped_or_failed(None)
        except BaseException as exc:
            if on_failure is not None and not isinstance(exc, asyncio.CancelledError):
                on_failure(exc)
            raise
        finally:
            await self._shutdown()

    def _spawn(self, coro: Any, name: str) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        task.add_done_callback(self._on_task_done)
        return task

    def _on_task_done(self, task: asyncio.Task) -> None:
        if task.cancelled():
            return
        exc = task.exception()
        if exc is not None and self._failure is not None and not self._failure.done():
            self._failure.set_exception(exc)

    async def _until_stopped_or_failed(self, task: asyncio.Task | None) -> None:
        """Wait until `task` (if any) is done, the trainer asks to stop, or a task failed (raise)."""
        while True:
            if self._failure.done():
                self._failure.result()  # raises the first task failure
            if self.channel.stop_event.is_set() or (task is not None and task.done()):
                return
            await asyncio.sleep(POLL_S)

    async def _shutdown(self) -> None:
        tasks = [t for t in self._tasks if not t.done()]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=10.0)
        try:
            await asyncio.wait_for(self.close(), timeout=60.0)
        finally:
            if self._client is not None:
                await asyncio.wait_for(self._client.close(), timeout=10.0)
            if self._executor is not None:
                self._executor.shutdown(wait=False, cancel_futures=True)

    async def _heartbeat(self) -> None:
        while True:
            self.channel.heartbeat.value = time.time()
            await asyncio.sleep(HEARTBEAT_S)

    # -- the server -------------------------------------------------------------------------------

    async def _server(self) -> tuple[Any, Any]:
        """The generation client and server info, created on first use (custom hooks may never call it)."""
        if self._client is not None and self._server_info is not None:
            return self._client, self._server_info
        async with self._server_lock:
            if self._server_info is None:
                timeout_s = float(self.config.vllm_server_timeout)
                client = GenerationClient(
                    self.config.vllm_server_base_url,
                    timeout_s=timeout_s,
                    api_key=self.config.vllm_server_api_key,
                    on_retry=lambda: self._record(M.ROLLOUT_VLLM_RETRY_COUNT, 1),
                )
                self._client = client
                await client.start()
                await client.wait_until_ready(timeout_s)
                self._server_info = await client.detect()
                self._start_server_poller()
        return self._client, self._server_info

    def _model_kwargs(self, context: _RolloutContext | None) -> dict[str, Any]:
        """The served model to ask: the base model, or the LoRA adapter `lora_name`. A "{version}" in
        `lora_name` is the model version when the rollout started, so a rollout finishes under the
        adapter it started with (the trainer keeps max_staleness + 1 versions loaded)."""
        if not self.lora_name:
            return {}
        current = int(self.channel.model_version.value)
        version = context.model_version if context is not None else current
        # LoRA hook: a rollout already too stale to train asks for the oldest version still registered
        version = max(version, oldest_fresh_version(current, int(self.config.max_staleness)))
        return {"model": self.lora_name.format(version=version)}

    def _wants_candidates(self, info: Any) -> bool:
        config = self.config
        truncated = int(config.top_k or 0) > 0 or float(config.top_p) < 1.0 or float(config.min_p or 0.0) > 0.0
        if not truncated:
            return False
        if info.supports_sampling_mask:
            return True
        if not self._warned_candidates:
            self._warned_candidates = True
            logger.warning(
                "top_k=%s / top_p=%s / min_p=%s truncate sampling, but the server at %s cannot return the "
                "candidate sets (needs vLLM >= 0.28 with --return-sampling-mask --enable-scale-out): the trainer "
                "normalises over the full vocabulary and importance ratios are biased",
                config.top_k, config.top_p, config.min_p, config.vllm_server_base_url,
            )
        return False

    def _start_server_poller(self) -> None:
        info = self._server_info
        self._kv_cap = ConcurrencyCap(
            self.max_concurrent_rollouts,
            kv_cache_tokens=info.kv_cache_tokens if info.has_metrics else None,
            max_model_len=info.max_model_len,
        )
        self._record(M.ROLLOUT_CONCURRENCY_CAP, self._concurrency_cap())
        if info.has_metrics:  # the vllm_* metrics are logged even when the cap cannot adapt
            self._spawn(self._poll_server_metrics(), "server-poller")

    async def _poll_server_metrics(self) -> None:
        last_preemptions: float | None = None
        last_prefix: tuple[float, float] | None = None
        while True:
            await asyncio.sleep(SERVER_POLL_S)
            snapshot = await self._client.metrics()
            if snapshot is None:
                continue
            self._record(M.ROLLOUT_VLLM_KV_CACHE_USAGE_FRAC, _nan(snapshot.kv_cache_usage_frac))
            self._record(M.ROLLOUT_VLLM_RUNNING_REQUESTS, _nan(snapshot.num_requests_running))
            self._record(M.ROLLOUT_VLLM_QUEUED_REQUESTS, _nan(snapshot.num_requests_waiting))
            if snapshot.num_preemptions is not None:
                if last_preemptions is not None:
                    self._record(M.ROLLOUT_VLLM_PREEMPTION_COUNT, max(snapshot.num_preemptions - last_preemptions, 0))
                last_preemptions = snapshot.num_preemptions
            if snapshot.prefix_cache_queries is not None and snapshot.prefix_cache_hits is not None:
                prefix = (snapshot.prefix_cache_queries, snapshot.prefix_cache_hits)
                if last_prefix is not None and prefix[0] > last_prefix[0]:
                    hit_frac = (prefix[1] - last_prefix[1]) / (prefix[0] - last_prefix[0])
                    self._record(M.ROLLOUT_VLLM_PREFIX_CACHE_HIT_FRAC, hit_frac)
                last_prefix = prefix
            if snapshot.kv_cache_usage_frac is not None:
                self._kv_cap.on_server_load(snapshot.kv_cache_usage_frac, int(snapshot.num_requests_waiting or 0))
            self._record(M.ROLLOUT_CONCURRENCY, self._in_flight)
            self._record(M.ROLLOUT_CONCURRENCY_CAP, self._concurrency_cap())

    def _concurrency_cap(self) -> int:
        cap = self.max_concurrent_rollouts
        if self._kv_cap is not None:
            cap = min(cap, int(self._kv_cap.cap))
        return max(cap, 1)

    # -- admission and dispatch -------------------------------------------------------------------

    def _queued_and_in_flight_tokens(self, view: TrainerView) -> float:
        queued = self._produced_tokens - view.consumed_tokens
        estimate = self._tokens_per_rollout or 0.0
        return max(queued, 0) + self._pending_tokens + self._in_flight * estimate

    def _blocker(self, num_rollouts: int, view: TrainerView) -> str | None:
        """What keeps a group of `num_rollouts` from starting now (None: it may start), given the
        trainer's values `view`. With no group open only IDLE_STALENESS or IDLE_ON_POLICY can block."""
        if self._in_flight > 0 and self._in_flight + num_rollouts > self._concurrency_cap():
            return "concurrency"
        if not may_start_group(
            held_tokens=math.ceil(self._queued_and_in_flight_tokens(view)),
            allowance=view.token_allowance,
            groups_finished=self._groups_generated,
            groups_in_flight=self._num_groups_generating,
        ):
            return IDLE_STALENESS if self._groups_generated else "first group"
        if self.config.max_staleness == 0 and self._on_policy_step_full(view):
            return IDLE_ON_POLICY
        return None

    def _on_policy_step_full(self, view: TrainerView) -> bool:
        """With max_staleness=0, one step's worth of tokens is generated per weight version; the next
        groups wait for the trainer's sync instead of producing samples that would be dropped stale."""
        if view.model_version != self._policy_version:
            self._policy_version, self._tokens_started_at_version = view.model_version, 0.0
        return self._groups_generated > 0 and self._tokens_started_at_version >= view.token_allowance

    async def _admit(self, num_rollouts: int) -> None:
        """Wait until a group may start; time spent on the staleness limit is `rollout/backpressure_s`.

        Blocked with no group open, the loop has nothing more coming until the trainer moves: it says
        so with a `RolloutIdle` carrying the trainer values it is blocked against (again whenever they
        change and it is still blocked).
        """
        backpressure_s = 0.0
        while True:
            view = self.channel.trainer_view()  # one consistent read: the idle item names what it saw
            blocker = self._blocker(num_rollouts, view)
            if blocker is None:
                break
            if self._groups_open == 0:
                assert blocker in (IDLE_STALENESS, IDLE_ON_POLICY), f"blocked on {blocker!r} with no group open"
                self._announce_idle(RolloutIdle(blocker, view))
            start = time.perf_counter()
            await self._wait_for_progress(POLL_S)
            if blocker in (IDLE_STALENESS, IDLE_ON_POLICY):
                backpressure_s += time.perf_counter() - start
        self._idle_sent = None
        if backpressure_s > 0:
            self._record(M.ROLLOUT_BACKPRESSURE_S, backpressure_s)

    def _announce_idle(self, item: RolloutIdle) -> None:
        if item != self._idle_sent:
            self._put_sample_item(item)
            self._idle_sent = item

    async def _wait_for_progress(self, timeout_s: float | None) -> None:
        """Until a rollout or group of this process finishes, or `timeout_s` passed (None: no limit)."""
        try:
            await asyncio.wait_for(self._progressed.wait(), timeout_s)
        except asyncio.TimeoutError:
            pass
        self._progressed.clear()

    async def _end_of_prompts(self) -> None:
        """After the last dispatch: once every open group is on the queue, tell the trainer nothing more comes."""
        while self._groups_open:
            await self._wait_for_progress(None)
        self._put_sample_item(RolloutIdle(IDLE_OUT_OF_PROMPTS, None))

    def _prompt_stream(self) -> Iterator[PromptItem]:
        """The prompt stream; without a dataset, an endless stream of empty rows for reset() to fill."""
        if self.dataset is not None:
            data_seed = getattr(self.config, "data_seed", None)
            yield from iter_prompts(
                self.dataset,
                seed=int(self.config.seed if data_seed is None else data_seed),
                start_position=self.dataset_start_index,
                filter_prompt=self.filter_prompt,
                prompt_required=self._environments is None,
                skip_positions=self.dataset_skip_positions,
            )
            return
        for position in itertools.count(self.dataset_start_index):
            skip = position in self.dataset_skip_positions
            yield PromptItem(position, 0, position, {}, not skip and bool(self.filter_prompt(position, {}, 0)))

    async def _dispatch(self) -> None:
        """Admit, then take the next accepted prompt (so `filter_prompt` sees the latest scores)."""
        stream = self._prompt_stream()
        while True:
            await self._admit(self.num_generations)
            for item in stream:
                if self._last_position is not None and item.position >= self._last_position:
                    logger.info("all %d prompts of the run were dispatched: no new rollouts will start", self._last_position)
                    await self._end_of_prompts()
                    return
                if item.accepted:
                    break
                self._put_sample_item(GroupFinished(item.position, item.row_index, 0))
                await asyncio.sleep(0)  # a long run of rejected prompts must not starve the heartbeat
            else:
                logger.info("the prompt stream ended: no new rollouts will start")
                await self._end_of_prompts()
                return
            group_id, self._next_group_id = self._next_group_id, self._next_group_id + 1
            started = _Started(self._policy_version, self.num_generations * (self._tokens_per_rollout or 0.0))
            self._tokens_started_at_version += started.tokens
            self._in_flight += self.num_generations
            self._num_groups_generating += 1
            self._groups_open += 1
            self._record(M.ROLLOUT_CONCURRENCY, self._in_flight)
            self._record(M.ROLLOUT_CONCURRENCY_CAP, self._concurrency_cap())
            self._spawn(self._run_group(item.position, item.row_index, item.row, group_id, started), f"group-{group_id}")

    # -- one group --------------------------------------------------------------------------------

    async def _run_group(
        self, position: int, row_index: int, row: dict[str, Any], group_id: int, started: _Started
    ) -> None:
        model_version = int(self.channel.model_version.value)
        prompt = list(row.get("prompt") or [])
        reward_kwargs = {k: [v] * self.num_generations for k, v in row.items() if k != "prompt"}
        try:
            results = await asyncio.gather(
                *(
                    self._run_rollout(prompt, row, _RolloutContext(position, i, model_version), group_id)
                    for i in range(self.num_generations)
                )
            )
        finally:
            self._num_groups_generating -= 1
        self._groups_generated += 1
        rollouts = [r for r, _, _ in results]
        reconciled = [reconcile_turns(r.turns, r.rollout_id) for r in rollouts]
        self._record_generation_metrics(rollouts, reconciled)
        num_tokens = sum(len(s) for rec in reconciled for s in rec.sequences)
        self._update_token_estimate(num_tokens / len(rollouts))
        group = RolloutGroup.from_rollouts(
            rollouts,
            [rec.sequences for rec in reconciled],
            prompt=prompt,
            reward_kwargs=reward_kwargs,
            model_version=model_version,
            group_id=group_id,
            row_index=row_index,
            env_rewards=[env_reward for _, env_reward, _ in results],
        )
        group.prompts = [p for _, _, p in results]
        self._pending_tokens += num_tokens
        start = time.perf_counter()
        group.queued_at = time.monotonic()
        await self._score_queue.put(_Pending(group, rollouts, position, num_tokens, started))
        self._record(M.ROLLOUT_SCORE_BLOCK_S, time.perf_counter() - start)
        self._record(M.ROLLOUT_SCORE_QUEUE_SIZE, self._score_queue.qsize())

    async def _run_rollout(
        self, prompt: list[dict[str, Any]], row: dict[str, Any], context: _RolloutContext, group_id: int
    ) -> tuple[Rollout, tuple[type, float] | None, list[dict[str, Any]]]:
        """One rollout with its environment (if any); returns it, its env reward and its prompt."""
        _CURRENT_ROLLOUT.set(context)
        start = time.perf_counter()
        try:
            if self._environments is None:
                rollout = await self.generate_one(prompt, list(self.tools), group_id)
                return self._checked(rollout), None, prompt
            rollout, env_reward, env_prompt = await run_in_environment(
                self._environments,
                row,
                prompt,
                self.tools,
                generate=lambda p, t: self.generate_one(p, t, group_id),
                executor=self._executor,
                record=self.channel.metrics.put,
            )
            return self._checked(rollout), env_reward, env_prompt
        finally:
            self._in_flight -= 1
            self._progressed.set()
            if self._kv_cap is not None:
                self._kv_cap.on_rollout_finished()
            self._record(M.ROLLOUT_DURATION_S, time.perf_counter() - start)

    @staticmethod
    def _checked(rollout: Any) -> Rollout:
        if not isinstance(rollout, Rollout):
            raise TypeError(f"generate_one must return an asyncgrpo.Rollout, got {type(rollout).__name__}")
        return rollout

    def _update_token_estimate(self, tokens_per_rollout: float) -> None:
        if self._tokens_per_rollout is None:
            self._tokens_per_rollout = float(tokens_per_rollout)
        else:  # follow completions that grow or shrink over the run
            self._tokens_per_rollout = 0.8 * self._tokens_per_rollout + 0.2 * float(tokens_per_rollout)

    # -- scoring ----------------------------------------------------------------------------------

    async def _score_forever(self) -> None:
        while True:
            try:
                pending = await asyncio.wait_for(self._score_queue.get(), timeout=1.0)
            except asyncio.TimeoutError:
                continue
            self._record(M.ROLLOUT_SCORE_WAIT_S, time.monotonic() - pending.group.queued_at)
            start = time.perf_counter()
            limit_s = float(getattr(self.config, "rollout_worker_timeout", 300.0))
            try:
                await asyncio.wait_for(self._score_group(pending), timeout=limit_s)
            except asyncio.TimeoutError:
                raise TimeoutError(
                    f"scoring group {pending.group.group_id} (position {pending.position}) took more than "
                    f"rollout_worker_timeout={limit_s:g} s: a reward function or an environment's get_reward "
                    "is stuck; fix it or raise rollout_worker_timeout"
                ) from None
            finally:
                self._pending_tokens -= pending.num_tokens
            self._groups_open -= 1  # its GroupFinished is on the queue
            self._progressed.set()
            self._record(M.ROLLOUT_SCORE_S, time.perf_counter() - start)

    async def _score_group(self, pending: _Pending) -> None:
        group = pending.group
        scores = await score_group(group, self.reward_funcs, self._reward_names)
        group.rewards = np.asarray(scores.totals, dtype=np.float64)
        advantages = adv.check_advantages(self.compute_advantages(group), len(group))
        dropped = adv.is_zero_std(group.rewards)
        warning = self._dropped_watch.observe(group.rewards, kept=not dropped)
        if warning is not None:
            logger.warning(warning)
        self._record_reward_metrics(group, scores, dropped)
        num_samples = 0
        if not dropped:
            num_samples = self._queue_samples(pending, advantages)
        if num_samples == 0 and pending.started.policy_version == self._policy_version:
            # the trainer gets nothing from this group: with max_staleness=0 it is not part of the step's
            # worth, or a version whose groups are all dropped would wait for a sync that never comes
            self._tokens_started_at_version = max(self._tokens_started_at_version - pending.started.tokens, 0.0)
        self._put_sample_item(GroupFinished(pending.position, group.row_index, num_samples))
        if getattr(self.config, "log_completions", False):
            self._log_completion(pending, advantages)

    def _queue_samples(self, pending: _Pending, advantages: np.ndarray) -> int:
        group = pending.group
        samples = group_samples(group, [r.rollout_id for r in pending.rollouts], advantages)
        for sample in samples:
            self._produced_tokens += len(sample.token_ids)
            num_trained = int(sample.trained_mask.sum())
            self._put_sample_item(QueuedSample(sample, pending.position, group.row_index, time.time(), num_trained))
        return len(samples)

    def _put_sample_item(self, item: Any) -> None:
        self.channel.samples.put(item)

    def _log_completion(self, pending: _Pending, advantages: np.ndarray) -> None:
        """`log_completions`: the group's first rollout, to `channel.extra["completions"]` if the trainer
        made that queue, else to this process's log."""
        group = pending.group
        entry = {
            "position": pending.position,
            "group_id": group.group_id,
            "model_version": group.model_version,
            "prompt": group.prompts[0],
            "completion": group.completions[0],
            "reward": float(group.rewards[0]),
            "advantage": float(advantages[0]),
        }
        completions_queue = getattr(self.channel, "extra", {}).get("completions")
        if completions_queue is not None:
            completions_queue.put(entry)
        else:
            text = " | ".join(str(m.get("content", "")) for m in group.completions[0])
            logger.info("group %d (position %d), reward %.3f: %s", group.group_id, pending.position, entry["reward"], text)

    # -- metrics ----------------------------------------------------------------------------------

    def _record(self, name: str, value: float) -> None:
        self.channel.metrics.put(M.metric(name, value))

    def _record_generation_metrics(self, rollouts: list[Rollout], reconciled: list[Any]) -> None:
        now = time.perf_counter()
        records = generation_records(
            rollouts, reconciled, eos_token_ids=self.eos_token_ids, has_tools=self._has_tools, seconds=now - self._rate_mark
        )
        self._rate_mark = now
        for record in records:
            self.channel.metrics.put(record)

    def _record_reward_metrics(self, group: RolloutGroup, scores: Any, dropped: bool) -> None:
        samples_per_rollout = [len(s) for s in group.completions_sequences]
        for record in reward_records(group.rewards, scores.per_source, samples_per_rollout, dropped=dropped):
            self.channel.metrics.put(record)


def reward_records(
    rewards: np.ndarray,
    per_source: Mapping[str, np.ndarray],
    samples_per_rollout: Sequence[int],
    *,
    dropped: bool,
) -> list[M.MetricRecord]:
    """Reward metrics of one scored group (NaN = unscored rollout).

    `reward` covers every scored rollout; `reward_kept` / `reward_dropped` split it by the group's
    fate; `frac_reward_zero_std` is one 0/1 item per group. For a kept group, `reward_group_std` and
    `rewards/{source}/group_std` are weighted by the group's trained samples and
    `rewards/{source}/mean` by each rollout's samples ("over trained samples"); a source that scored no
    rollout of the group (None: not applicable, e.g. another environment's task) records neither.
    """
    scored = rewards[~np.isnan(rewards)]
    records = [M.metric(M.FRAC_REWARD_ZERO_STD, float(dropped))]
    split = M.REWARD_DROPPED if dropped else M.REWARD_KEPT
    for value in scored:
        records += [M.metric(M.REWARD, value), M.metric(split, value)]
    if dropped:
        return records
    num_samples = sum(samples_per_rollout)
    records.append(M.metric(M.REWARD_GROUP_STD, adv.scored_std(rewards), weight=num_samples))
    for name, values in per_source.items():
        for value, count in zip(values, samples_per_rollout, strict=True):
            if count and not math.isnan(value):
                records.append(M.metric(M.reward_mean(name), value, weight=count))
        if not np.isnan(values).all():  # a source that applies to none of the group's rollouts has no std
            records.append(M.metric(M.reward_group_std(name), adv.scored_std(values), weight=num_samples))
    return records


def group_samples(group: RolloutGroup, rollout_ids: Sequence[str], advantages: np.ndarray) -> list[Sample]:
    """The training samples of a kept group: every sequence of rollout i carries advantage i."""
    samples = []
    for rollout_id, sequences, advantage in zip(rollout_ids, group.completions_sequences, advantages, strict=True):
        for seq in sequences:
            samples.append(
                Sample(
                    token_ids=seq.token_ids,
                    trained_mask=seq.trained_mask,
                    sampler_logprobs=seq.sampler_log_probs,
                    advantage=float(advantage),
                    group_id=group.group_id,
                    sampler_topk=_topk_pairs(seq.sampler_top_logprobs),
                    candidate_sets=seq.sampling_candidates,
                    model_version=group.model_version,
                    rollout_id=rollout_id,
                )
            )
    return samples


def _topk_pairs(top: list[dict[int, float] | None] | None) -> list[tuple[tuple[int, float], ...] | None] | None:
    """Per-token {token id: log-prob} dicts -> the ((id, log-prob), ...) form `Sample` takes."""
    if top is None:
        return None
    return [None if entry is None else tuple(entry.items()) for entry in top]


def _last_position(config: Any, dataset: Any) -> int | None:
    """First position past the run when epochs stop it (None: max_steps stops it, or a stream)."""
    if getattr(config, "max_steps", -1) > 0 or dataset is None:
        return None
    try:
        n = len(dataset)
    except TypeError:
        return None
    return math.ceil(float(config.num_train_epochs) * n)


def _nan(value: float | None) -> float:
    return math.nan if value is None else float(value)
