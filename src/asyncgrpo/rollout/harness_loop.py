"""`HarnessRolloutLoop`: the rollout loop whose rollouts are runs of a user's harness.

    group task --generate_one--> slot (max_concurrent_harnesses) --> proxy.open(): base URL + key
        harness(run) --HTTP--> RecordingProxy --forward--> server (the config's sampling, a run seed)
                                   |  each call's TurnRecords (prompt ids, output ids, sampler log-probs)
        outcome: reward | failed | timeout | no call (counted, warned, never raised)
    --> Rollout(turns = the calls' turns in call order, reward = the harness's)
    --> the base loop: reconcile_turns (extend or fork) -> rewards -> compute_advantages -> samples

Everything after `generate_one` is the base loop's (admission, staleness, weight versions, reward
functions, metrics). A rollout whose harness failed, timed out or made no call has no turns and no
reward: `compute_advantages` leaves it out of its group's statistics (NaN), as a rollout that no
reward source scored. The `completion` reward functions get is the last call's conversation
after its first user message, then its reply (`recorded_completion`).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
import uuid
from collections.abc import Callable
from typing import Any

import numpy as np

from asyncgrpo import metrics as M
from asyncgrpo.data.tool_calls import calls_from_wire
from asyncgrpo.rollout import advantages as adv
from asyncgrpo.rollout import harness_calls
from asyncgrpo.rollout.harness import FAILED, NO_CALL, TIMEOUT, HarnessRun, as_harness, run_harness
from asyncgrpo.rollout.harness_proxy import Emit, ProxySession, RecordedCall, RecordingProxy
from asyncgrpo.rollout.loop import AsyncRolloutLoop
from asyncgrpo.rollout.requests import CURRENT_ROLLOUT, request_seed
from asyncgrpo.types import Rollout, RolloutGroup

logger = logging.getLogger(__name__)

_COUNTS = {FAILED: M.HARNESS_FAILED_COUNT, TIMEOUT: M.HARNESS_TIMEOUT_COUNT, NO_CALL: M.HARNESS_NO_CALL_COUNT}
_EMPTY_COMPLETION = ({"role": "assistant", "content": ""},)


async def record_call(
    client: Any, path: str, body: dict[str, Any], session: ProxySession, emit: Emit | None, *,
    settings: Any, seed: int, model: str, decode: Callable[[int], str],
) -> tuple[int, Any, dict[str, Any]]:
    """One harness call sent to `client` with the trainer's sampling `settings` and `seed`, its turns
    recorded into `session`: (status, the reply as the harness sees it (None once streamed through
    `emit`), the harness's sampling fields that were overridden)."""
    upstream, asked, overridden = harness_calls.upstream_body(path, body, settings=settings, seed=seed,
                                                              model=model)
    if emit is None:
        status, reply = await client.openai_request(path, upstream)
        if status >= 400:
            return status, reply, overridden
    else:
        gathered = harness_calls.StreamedReply(path)
        usage_chunk = harness_calls.wants_usage_chunk(body)

        async def on_chunk(chunk: dict[str, Any]) -> None:
            gathered.add(chunk)
            if chunk.get("choices") or usage_chunk:
                await emit(harness_calls.harness_view(path, chunk, asked, decode))

        status, error = await client.openai_stream(path, harness_calls.stream_body(upstream), on_chunk)
        if status >= 400:
            return status, error, overridden
        reply = gathered.reply()
    if not session.open:  # the rollout ended while the call ran: nothing recorded
        gone = {"error": {"message": "this harness session is over", "type": "Gone", "code": 410}}
        return 410, gone, overridden
    turns = harness_calls.recorded_turns(path, reply, num_logprobs=settings.num_logprobs)
    session.calls.append(RecordedCall(path, upstream, reply, turns))
    if emit is not None:
        return status, None, overridden
    return status, harness_calls.harness_view(path, reply, asked, decode), overridden


class HarnessRolloutLoop(AsyncRolloutLoop):
    """`AsyncRolloutLoop` whose `generate_one` runs `harness` against a recording proxy.

    Args:
        harness: A callable taking a `HarnessRun` (sync or async) or a command (see
            `asyncgrpo.rollout.harness`). Other arguments: `AsyncRolloutLoop`'s.
    """

    provides_rollout_reward = True

    def __init__(self, *args: Any, harness: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.harness = as_harness(harness)
        self._proxy: RecordingProxy | None = None
        self._slots: asyncio.Semaphore | None = None
        self._warned_overrides: set[str] = set()

    async def setup(self) -> None:
        # the openai SDK logs every request at INFO (httpx): one line per model call of every harness
        if logging.getLogger("httpx").level == logging.NOTSET:
            logging.getLogger("httpx").setLevel(logging.WARNING)
        _, info = await self._server()
        self._proxy = RecordingProxy(self._forward, model=info.model_name)
        await self._proxy.start()
        limit = self.config.max_concurrent_harnesses or self.max_concurrent_rollouts
        self._slots = asyncio.Semaphore(int(limit))

    async def close(self) -> None:
        if self._proxy is not None:
            await self._proxy.close()

    def compute_advantages(self, group: RolloutGroup) -> np.ndarray:
        """As the base loop's, with the rollouts that have nothing to train (a failed harness) unscored."""
        group.rewards = unscored_without_sequences(group.rewards, group.completions_sequences)
        return adv.compute_advantages(group.rewards)

    async def generate_one(self, prompt: list[dict[str, Any]], tools: list, group_id: int = 0) -> Rollout:
        """One harness run on a session of its own: its recorded turns and reward, or (a failure, counted and
        warned about) a rollout with nothing to train."""
        context = CURRENT_ROLLOUT.get()
        rollout_id = uuid.uuid4().hex
        assert self._slots is not None and self._proxy is not None, "setup() starts the proxy before rollouts"
        async with self._slots:
            session = self._proxy.open(context)
            run = HarnessRun(
                base_url=session.base_url, api_key=session.api_key, model=session.model, prompt=list(prompt),
                row=dict(getattr(context, "row", None) or {}), rollout_id=rollout_id, group_id=group_id,
            )
            start = time.perf_counter()
            try:
                outcome = await run_harness(self.harness, run, timeout_s=float(self.config.harness_timeout),
                                            executor=self._executor)
            finally:
                self._proxy.release(session)
            self._record(M.HARNESS_DURATION_S, time.perf_counter() - start)
        if session.server_error is not None:  # not the harness's failure: the run's, as in any rollout
            raise session.server_error
        calls = list(session.calls)
        failure, detail = outcome.failure, outcome.detail
        if failure is None and not calls:
            failure, detail = NO_CALL, "ended without calling the model (no request reached its base_url)"
        for kind, name in _COUNTS.items():
            self._record(name, float(failure == kind))
        self._record(M.HARNESS_CALLS_MEAN, len(calls))
        where = f"group {group_id}, rollout {rollout_id[:8]}"
        if failure is not None:
            logger.warning("harness %s %s (%s); the rollout is left out of its group's advantages and "
                           "counted in %s", _name(self.harness), detail, where, _COUNTS[failure])
            return Rollout(completion=[dict(m) for m in _EMPTY_COMPLETION], completion_ids=[], turns=[],
                           rollout_id=rollout_id)
        turns = [turn for call in calls for turn in call.turns]
        return Rollout(
            completion=recorded_completion(calls[-1]),
            completion_ids=[t for turn in turns for t in turn.output_ids],
            turns=turns,
            tool_call_count=sum(_num_tool_calls(call) for call in calls),
            reward=outcome.reward,
            rollout_id=rollout_id,
        )

    async def _forward(
        self, path: str, body: dict[str, Any], session: ProxySession, emit: Emit | None
    ) -> tuple[int, Any]:
        """One call of a harness: to the server with the trainer's sampling, recorded into `session`;
        streamed to the harness chunk by chunk when `emit` is given."""
        context = session.context
        client, info = await self._server(context)  # the server of the rollout's group
        position, index = (context.position, context.rollout_index) if context is not None else (-1, 0)
        seed = request_seed(int(self.config.seed), position, index, session.num_requests)
        session.num_requests += 1
        model = self._model_kwargs(context).get("model", info.model_name)
        status, reply, overridden = await record_call(
            client, path, body, session, emit, settings=self._request_settings, seed=seed, model=model,
            decode=self._decode_token,
        )
        self._warn_overrides(overridden)
        return status, reply

    def _decode_token(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def _warn_overrides(self, overridden: dict[str, Any]) -> None:
        new = sorted(set(overridden) - self._warned_overrides)
        if new:
            self._warned_overrides.update(new)
            settings = self._request_settings
            logger.warning(
                "a harness asked for %s; the recording proxy samples with the trainer's settings instead "
                "(temperature=%g, top_p=%g, top_k=%d, min_p=%g, no penalties or logit_bias), which the loss "
                "assumes. Set them in AsyncGRPOConfig to change them (said once per field)",
                ", ".join(f"{k}={overridden[k]!r}" for k in new), settings.temperature, settings.top_p,
                settings.top_k, settings.min_p,
            )


def unscored_without_sequences(rewards: np.ndarray, sequences: list[list[Any]]) -> np.ndarray:
    """`rewards` with NaN where a rollout has no training sequence (pure; shape (num_rollouts,))."""
    out = np.array(rewards, dtype=np.float64, copy=True)
    for i, seqs in enumerate(sequences):
        if not seqs:
            out[i] = math.nan
    return out


def recorded_completion(call: RecordedCall) -> list[dict[str, Any]]:
    """The completion reward functions see for a harness run whose last call is `call`: the chat messages
    after the first user message (the task), then the reply of its first choice; for `/v1/completions`,
    the text of its first choice as one assistant message."""
    choices = call.reply.get("choices") or [{}]
    if call.path != harness_calls.CHAT_PATH:
        return [{"role": "assistant", "content": choices[0].get("text") or ""}]
    messages = list(call.request.get("messages") or [])
    first_user = next((i for i, m in enumerate(messages) if m.get("role") == "user"), -1)
    reply = {k: v for k, v in (choices[0].get("message") or {}).items() if v is not None}
    reply.setdefault("role", "assistant")
    return [_template_form(m) for m in [*messages[first_user + 1:], reply]]


def _template_form(message: dict[str, Any]) -> dict[str, Any]:
    """A message with its tool calls' arguments as objects, as the other trainers' reward functions see
    them."""
    message = dict(message)
    if message.get("tool_calls"):
        try:
            message["tool_calls"] = calls_from_wire(message["tool_calls"])
        except ValueError:  # kept as the harness sent it
            pass
    return message


def _num_tool_calls(call: RecordedCall) -> int:
    return sum(len((c.get("message") or {}).get("tool_calls") or []) for c in call.reply.get("choices") or [])


def _name(harness: Any) -> str:
    argv = getattr(harness, "argv", None)
    if argv:
        return repr(" ".join(argv)[:80])
    return repr(getattr(harness, "__name__", None) or type(harness).__name__)
