"""`AsyncRolloutLoop`: the asyncio side of the rollout process (constructed inside the spawned child).

    prompts --filter_prompt--> dispatcher --admit (3 limits)--> group task: num_generations x rollout
                                   ^                                 | generate_one -> generate_one_turn
                                   | slot freed / allowance moved    v
                              heartbeat (1 s)                  score queue (bounded: score_block_s)
                              server poller (/metrics, 5 s)          |
                              (a group runs on one server: the one with the most free capacity)
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

This module keeps the hooks, `run`, the dispatcher and the group tasks. The rest of the process:

    admission.py        the rule a group is admitted by (pure; the trainer's side of it too)
    admission_gate.py   the dispatcher's wait on that rule, and the `RolloutIdle` markers it sends
    server_load.py      per server a client and a KV cap; the choice of a group's server; the poller
    scoring.py          the scorer
    tasks.py            task supervision

Every wait polls with a short timeout, so a stop request or a failed task is seen within a fraction of
a second. Any exception in any task stops the loop: `run()` cancels the others, runs `close()` and
re-raises (the process shell reports it to the trainer).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from asyncgrpo import metrics as M
from asyncgrpo.config_rules import server_urls
from asyncgrpo.data.prompts import PromptItem, end_position, prompt_stream, row_reward_kwargs
from asyncgrpo.generation.client import GenerationClient
from asyncgrpo.generation.server_info import ServerInfo
from asyncgrpo.generation.transport import ServerConnectionError, ServerRequestError
from asyncgrpo.rollout import advantages as adv
from asyncgrpo.rollout.admission import Admission, Started, oldest_fresh_version
from asyncgrpo.rollout.admission_gate import AdmissionGate
from asyncgrpo.rollout.channel import GroupFinished, QueuedSample, RolloutChannel, RolloutIdle
from asyncgrpo.rollout.generate import (
    EnvironmentPool,
    generation_records,
    run_in_environment,
    run_tool_loop,
)
from asyncgrpo.rollout.reconcile import reconcile_turns
from asyncgrpo.rollout.requests import CURRENT_ROLLOUT, RequestSeeds, RequestSettings, RolloutContext
from asyncgrpo.rollout.rewards import reward_func_names
from asyncgrpo.rollout.scoring import PendingGroup, Scorer
from asyncgrpo.rollout.server_load import ServerLoads
from asyncgrpo.rollout.tasks import TaskSupervisor
from asyncgrpo.types import Rollout, RolloutGroup, TurnRecord

logger = logging.getLogger(__name__)

HEARTBEAT_S = 1.0


class AsyncRolloutLoop:
    """Generates and scores rollouts for `AsyncGRPOTrainer`, in the spawned rollout process.

    The default implements GRPO. Subclass it (at module level: it is pickled by reference), override
    only the hooks that change and set the subclass as the trainer's `loop_cls`. Each prompt goes
    through `filter_prompt` -> `generate_one` (which calls `generate_one_turn` per sampling request)
    -> the group's rewards (reward_funcs + environments' `get_reward` + `Rollout.reward`) ->
    `compute_advantages`. `setup()` / `close()` run on the loop's event loop. Hooks may read
    `self.config` and `self.tokenizer`.

    A subclass whose `generate_one` sets `Rollout.reward` may set `provides_rollout_reward = True`:
    the trainer then accepts it without `reward_funcs` or an environment's `get_reward`.
    """

    provides_rollout_reward: bool = False

    def __init__(
        self,
        config: Any,
        model_name: str,
        dataset: Any,
        reward_funcs: list[Callable] | None,
        processing_class: Any,
        eos_token_ids: list[int],
        rollout_buffer: Any = None,
        model_version_value: Any = None,
        token_allowance: Any = None,
        heartbeat_value: Any = None,
        failed_event: Any = None,
        exception_info_queue: Any = None,
        metrics_queue: Any = None,
        tools: list[Callable] | None = None,
        environment_factory: Callable[[], Any] | dict[str, Callable[[], Any]] | None = None,
        score_queue_maxsize: int = 16,
        lora_name: str | None = None,
        dataset_start_index: int = 0,
        *,
        channel: RolloutChannel | None = None,
        dataset_skip_positions: Sequence[int] = (),
        expects_pushed_weights: bool = False,
    ) -> None:
        """The reference's arguments, in its order. The shared primitives come either one by one, as in the
        reference (`rollout_buffer` ... `metrics_queue`; a stop event and a consumed-tokens counter are then
        made here: stop the loop with `self.channel.stop_event.set()`), or together as `channel`, a
        `RolloutChannel` (what the rollout process passes). `dataset_skip_positions` (prompts trained
        above the resume position) and `expects_pushed_weights` (the trainer pushed its weights before
        the first rollout) are set by the trainer."""
        if dataset is None and environment_factory is None:
            raise ValueError("dataset is None: pass a train_dataset, or an environment_factory whose reset() "
                             "returns the prompt")
        primitives = {
            "rollout_buffer": rollout_buffer, "model_version_value": model_version_value,
            "token_allowance": token_allowance, "heartbeat_value": heartbeat_value,
            "failed_event": failed_event,
            "exception_info_queue": exception_info_queue, "metrics_queue": metrics_queue,
        }
        if channel is None:
            channel = RolloutChannel.from_primitives(**primitives)
        elif any(value is not None for value in primitives.values()):
            given = ", ".join(name for name, value in primitives.items() if value is not None)
            raise TypeError(
                f"AsyncRolloutLoop takes either `channel` or the shared primitives one by one, not both; got "
                f"channel and {given}"
            )
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
        self._servers = ServerLoads(
            server_urls(config.vllm_server_base_url),
            timeout_s=float(config.vllm_server_timeout),
            restart_timeout_s=float(config.vllm_server_restart_timeout),
            api_key=config.vllm_server_api_key,
            max_concurrent_rollouts=self.max_concurrent_rollouts,
            record=self._record,
            expects_pushed_weights=expects_pushed_weights,
        )
        self._poller: asyncio.Task | None = None
        self._scorer: Scorer | None = None
        self._supervisor: TaskSupervisor | None = None
        self._admission = Admission(int(config.max_staleness))
        self._gate: AdmissionGate | None = None  # where the dispatcher waits for admission
        # epoch-based runs (max_steps <= 0) end after num_train_epochs passes over the dataset
        self._last_position = end_position(config.max_steps, config.num_train_epochs, dataset)
        self._reward_names = reward_func_names(self.reward_funcs)  # checks them before the run starts
        self._next_group_id = 0
        self._rate_mark = time.perf_counter()  # start of the span the next generated-tokens rate covers
        self._request_settings = RequestSettings.from_config(config, self.eos_token_ids)
        self._seeds = RequestSeeds(config.seed)

    def _join_pipeline(
        self,
        channel: RolloutChannel,
        *,
        dataset_skip_positions: Sequence[int] = (),
        expects_pushed_weights: bool = False,
    ) -> None:
        """For a subclass whose `__init__` has the reference's signature, which cannot take them: the
        rollout process hands over the whole channel (its stop event, consumed tokens, completions queue)
        and the trainer's resume settings after construction, before `run()`."""
        self.channel = channel
        self.dataset_skip_positions = frozenset(dataset_skip_positions)
        self._servers.set_expects_pushed_weights(expects_pushed_weights)

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

    async def generate_one(
        self, prompt: list[dict[str, Any]], tools: list[Callable], group_id: int = 0
    ) -> Rollout:
        """One rollout: the multi-turn tool loop (one turn when there are no tools)."""
        return await run_tool_loop(
            prompt,
            tools,
            generate_turn=self.generate_one_turn,
            tokenizer=self.tokenizer,
            eos_token_ids=self.eos_token_ids,
            chat_template_kwargs=dict(self.config.chat_template_kwargs or {}),
            max_iterations=self.config.max_tool_calling_iterations,
            executor=self._executor,
            record=self.channel.metrics.put,
            tool_timeout_s=self.config.tool_call_timeout,
        )

    async def generate_one_turn(self, prompt_ids: list[int]) -> TurnRecord:
        """One sampling request with the config's sampling settings and a unique seed, to the server of the
        rollout's group."""
        context = CURRENT_ROLLOUT.get()
        server = self._server_index(context)
        client, _ = await self._server(context)
        settings = self._request_settings
        wants_candidates = self._servers.wants_candidates(server, settings.truncated,
                                                          settings.describe_truncation())
        params = settings.params(seed=self._seeds.next(), return_sampling_mask=wants_candidates)
        while True:
            try:
                out = await self._generate(client, prompt_ids, params, context)
                break
            except ServerConnectionError as exc:  # several servers: sent again to another one
                moved = None if context is None or self.lora_name else self._servers.fail_over(server, exc)
                if moved is None:
                    raise
                context.server = server = moved
                client, _ = await self._server(context)
        return TurnRecord(
            prompt_ids=list(prompt_ids),
            output_ids=list(out.token_ids),
            output_log_probs=list(out.logprobs or []),
            output_sampling_mask=out.sampling_mask if params.return_sampling_mask else None,
            output_sampler_logprobs=out.top_logprobs if params.logprobs else None,
        )

    async def _generate(self, client: GenerationClient, prompt_ids: list[int], params: Any,
                        context: RolloutContext | None) -> Any:
        try:
            return await client.generate(list(prompt_ids), params, **self._model_kwargs(context))
        except ServerRequestError as exc:  # LoRA: the adapter was retired between naming and serving it
            if exc.status != 404 or not self.lora_name:
                raise
            return await client.generate(list(prompt_ids), params, **self._model_kwargs(context))

    # -- run --------------------------------------------------------------------------------------

    async def run(self, on_failure: Callable[[BaseException], None] | None = None) -> None:
        """Run until `channel.stop_event` is set (returns) or any task fails (raises).

        `on_failure(exc)` is called as soon as a task fails, before the other tasks are cancelled and
        `close()` runs, so the trainer hears about it without waiting for the shutdown.
        """
        self._supervisor = TaskSupervisor()
        self._gate = AdmissionGate(
            admission=self._admission, channel=self.channel, cap=self._servers.cap, record=self._record
        )
        self._scorer = Scorer(
            channel=self.channel,
            admission=self._admission,
            reward_funcs=self.reward_funcs,
            reward_names=self._reward_names,
            compute_advantages=self.compute_advantages,
            timeout_s=float(self.config.rollout_worker_timeout),
            log_completions=self.config.log_completions,
            on_progress=self._gate.on_progress,
            maxsize=self.score_queue_maxsize,
        )
        self._executor = ThreadPoolExecutor(self.max_concurrent_rollouts, thread_name_prefix="asyncgrpo-tool")
        self._rate_mark = time.perf_counter()
        self._spawn(self._heartbeat(), "heartbeat")
        setup = self._spawn(self.setup(), "setup")
        try:
            await self._supervisor.wait(self.channel.stop_event, setup)
            if self.channel.stop_event.is_set():
                return
            setup.result()  # raises what setup() raised
            self._spawn(self._dispatch(), "dispatcher")
            self._spawn(self._scorer.run(), "scorer")
            await self._supervisor.wait(self.channel.stop_event)
        except BaseException as exc:
            if on_failure is not None and not isinstance(exc, asyncio.CancelledError):
                on_failure(exc)
            raise
        finally:
            await self._shutdown()

    def _spawn(self, coro: Coroutine[Any, Any, Any], name: str) -> asyncio.Task:
        return self._supervisor.spawn(coro, name)

    async def _shutdown(self) -> None:
        await self._supervisor.cancel_all()
        try:
            await asyncio.wait_for(self.close(), timeout=60.0)
        finally:
            await self._servers.close()
            if self._executor is not None:
                self._executor.shutdown(wait=False, cancel_futures=True)

    async def _heartbeat(self) -> None:
        while True:
            self.channel.heartbeat.value = time.time()
            await asyncio.sleep(HEARTBEAT_S)

    # -- the server -------------------------------------------------------------------------------

    async def _server(self, context: RolloutContext | None = None) -> tuple[GenerationClient, ServerInfo]:
        """The generation client and server info of the rollout's server (`context.server`; outside a
        rollout, the one with the most free capacity), created on first use (custom hooks may never call
        it)."""
        client, info = await self._servers.connect(self._server_index(context))
        # the vllm_* metrics are logged even when the cap cannot adapt; several servers: it also takes a
        # server that stopped answering back in
        if (info.has_metrics or len(self._servers) > 1) and self._poller is None:
            self._poller = self._spawn(
                self._servers.poll_forever(lambda: self._admission.in_flight,
                                           lambda: int(self.channel.model_version.value)),
                "server-poller")
        return client, info

    def _server_index(self, context: RolloutContext | None) -> int:
        return context.server if context is not None else self._servers.choose()

    def _model_kwargs(self, context: RolloutContext | None) -> dict[str, Any]:
        """The served model to ask: the base model, or the LoRA adapter `lora_name`. A "{version}" in
        `lora_name` is the model version when the rollout started, so a rollout finishes under the
        adapter it started with (the trainer keeps max_staleness + 1 versions loaded)."""
        if not self.lora_name:
            return {}
        current = int(self.channel.model_version.value)
        version = context.model_version if context is not None else current
        # LoRA: a rollout already too stale to train asks for the oldest version still registered
        version = max(version, oldest_fresh_version(current, int(self.config.max_staleness)))
        return {"model": self.lora_name.format(version=version)}

    # -- dispatch ---------------------------------------------------------------------------------

    def _prompt_stream(self) -> Iterator[PromptItem]:
        data_seed = self.config.data_seed
        return prompt_stream(
            self.dataset,
            seed=int(self.config.seed if data_seed is None else data_seed),
            start_position=self.dataset_start_index,
            filter_prompt=self.filter_prompt,
            prompt_required=self._environments is None,
            skip_positions=self.dataset_skip_positions,
        )

    async def _dispatch(self) -> None:
        """Admit, then take the next accepted prompt (so `filter_prompt` sees the latest scores)."""
        stream = self._prompt_stream()
        while True:
            await self._gate.admit(self.num_generations)
            for item in stream:
                if self._last_position is not None and item.position >= self._last_position:
                    logger.info("all %d prompts of the run were dispatched: no new rollouts will start",
                                self._last_position)
                    await self._gate.end_of_prompts()
                    return
                if item.accepted:
                    break
                self._put_sample_item(GroupFinished(item.position, item.row_index, 0))
                await asyncio.sleep(0)  # a long run of rejected prompts must not starve the heartbeat
            else:
                logger.info("the prompt stream ended: no new rollouts will start")
                await self._gate.end_of_prompts()
                return
            group_id, self._next_group_id = self._next_group_id, self._next_group_id + 1
            started = self._admission.on_group_started(self.num_generations)
            server = self._servers.start_group(self.num_generations)
            self._servers.record_concurrency(self._admission.in_flight)
            self._spawn(self._run_group(item.position, item.row_index, item.row, group_id, started, server),
                        f"group-{group_id}")

    # -- one group --------------------------------------------------------------------------------

    async def _run_group(
        self, position: int, row_index: int, row: dict[str, Any], group_id: int, started: Started, server: int
    ) -> None:
        """The group's rollouts, all on server `server` (its prompt is cached there once)."""
        model_version = int(self.channel.model_version.value)
        prompt = list(row.get("prompt") or [])
        reward_kwargs = row_reward_kwargs(row, self.num_generations)
        try:
            results = await asyncio.gather(
                *(
                    self._run_rollout(prompt, row,
                                      RolloutContext(position, i, model_version, row=row, server=server),
                                      group_id)
                    for i in range(self.num_generations)
                )
            )
        finally:
            self._admission.on_generation_ended()
        rollouts = [r for r, _, _ in results]
        reconciled = [reconcile_turns(r.turns, r.rollout_id) for r in rollouts]
        self._record_generation_metrics(rollouts, reconciled)
        num_tokens = sum(len(s) for rec in reconciled for s in rec.sequences)
        self._admission.on_group_generated(num_tokens, len(rollouts))
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
        await self._scorer.put(PendingGroup(group, rollouts, position, num_tokens, started))

    async def _run_rollout(
        self, prompt: list[dict[str, Any]], row: dict[str, Any], context: RolloutContext, group_id: int
    ) -> tuple[Rollout, tuple[type, float] | None, list[dict[str, Any]]]:
        """One rollout with its environment (if any); returns it, its env reward and its prompt."""
        CURRENT_ROLLOUT.set(context)
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
            self._admission.on_rollout_finished()
            self._gate.on_progress()
            self._servers.on_rollout_finished(context.server)
            self._record(M.ROLLOUT_DURATION_S, time.perf_counter() - start)

    @staticmethod
    def _checked(rollout: Any) -> Rollout:
        if not isinstance(rollout, Rollout):
            raise TypeError(f"generate_one must return an asyncgrpo.Rollout, got {type(rollout).__name__}")
        return rollout

    def _put_sample_item(self, item: QueuedSample | GroupFinished | RolloutIdle) -> None:
        self.channel.samples.put(item)

    # -- metrics ----------------------------------------------------------------------------------

    def _record(self, name: str, value: float) -> None:
        self.channel.metrics.put(M.metric(name, value))

    def _record_generation_metrics(self, rollouts: list[Rollout], reconciled: list[Any]) -> None:
        now = time.perf_counter()
        records = generation_records(
            rollouts, reconciled, eos_token_ids=self.eos_token_ids, has_tools=self._has_tools,
            seconds=now - self._rate_mark,
        )
        self._rate_mark = now
        for record in records:
            self.channel.metrics.put(record)
