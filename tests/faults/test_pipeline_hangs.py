"""Fault 5 (pipeline side): a hanging tool call times out as a tool error; a run of dropped groups is
named from the rollout side; a missing server is announced within seconds."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from fault_helpers import MODEL, short_run_config, spread_reward

from asyncgrpo import AsyncGRPOTrainer
from asyncgrpo.launch import free_port
from asyncgrpo.rollout.dropped_groups import DroppedGroupsWatch
from asyncgrpo.rollout.generate import execute_tool_call, run_tool_loop
from asyncgrpo.tasks import arithmetic
from asyncgrpo.types import TurnRecord

RELEASE = threading.Event()  # lets the hung sync tool's thread end once the test is over


def stuck_lookup(key: str) -> str:
    """Looks a key up (and never returns).

    Args:
        key: The key.
    """
    RELEASE.wait(30)
    return key


async def stuck_async_lookup(key: str) -> str:
    """Looks a key up asynchronously (and never returns).

    Args:
        key: The key.
    """
    await asyncio.sleep(3600)
    return key


@pytest.mark.parametrize("tool", [stuck_lookup, stuck_async_lookup])
def test_a_hanging_tool_call_becomes_a_failed_call_after_its_timeout(tool):
    async def run():
        with ThreadPoolExecutor(1) as pool:
            try:
                return await execute_tool_call(tool.__name__, {"key": "a"},
                                               {tool.__name__: tool}, pool, timeout_s=0.3)
            finally:
                RELEASE.set()

    t0 = time.monotonic()
    result = asyncio.run(run())
    assert time.monotonic() - t0 < 5
    assert result.failed and not result.unknown_name
    assert result.content == f"Error: the tool {tool.__name__!r} timed out after 0.3 s."


class _CharTokenizer:
    """Renders a conversation as text and maps characters to ids (ord), enough for the tool loop."""

    def apply_chat_template(self, messages, tools=None, add_generation_prompt=True, tokenize=True, **kwargs):
        return [ord(c)
                for c in "".join(f"<{m['role']}>{m.get('content', '')}" for m in messages) + "<assistant>"]

    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(i) for i in ids)


def test_the_tool_loop_reports_the_timeout_to_the_model_and_counts_it():
    RELEASE.clear()
    answers = iter(['<tool_call>{"name": "stuck_lookup", "arguments": {"key": "a"}}</tool_call>', "Gave up."])

    async def generate_turn(prompt_ids):
        out = [ord(c) for c in next(answers)] + [0]
        return TurnRecord(prompt_ids=prompt_ids, output_ids=out, output_log_probs=[-1.0] * len(out))

    records = []

    async def run():
        with ThreadPoolExecutor(1) as pool:
            try:
                return await run_tool_loop(
                    [{"role": "user", "content": "look a up"}], [stuck_lookup], generate_turn=generate_turn,
                    tokenizer=_CharTokenizer(), eos_token_ids=[0],
                    chat_template_kwargs={}, max_iterations=None,
                    executor=pool, record=records.append, tool_timeout_s=0.3,
                )
            finally:
                RELEASE.set()

    rollout = asyncio.run(run())
    assert (rollout.tool_call_count, rollout.tool_failure_count) == (1, 1)  # -> tools/failure_frequency
    assert "timed out after 0.3 s" in rollout.completion[1]["content"]
    assert ("tools/stuck_lookup/failure_count", 1.0) in [(r[0], r[1]) for r in records]


def test_consecutive_dropped_groups_warn_once_a_count_is_reached_naming_the_cause():
    watch = DroppedGroupsWatch(warn_after=4)
    nan_group = np.full(4, np.nan)
    assert [watch.observe(nan_group, kept=False) for _ in range(3)] == [None] * 3
    message = watch.observe(nan_group, kept=False)
    assert "the last 4 groups were all dropped" in message and "every reward was None or NaN" in message
    assert [watch.observe(nan_group, kept=False) for _ in range(3)] == [None] * 3  # next one at 8
    assert "the last 8 groups" in watch.observe(nan_group, kept=False)

    assert watch.observe(np.array([0.0, 1.0]), kept=True) is None  # a kept group starts the count over
    constant = np.array([1.0, 1.0, 1.0, 1.0])
    messages = [watch.observe(constant, kept=False) for _ in range(4)]
    assert messages[:3] == [None] * 3
    assert "same reward (the latest: 1)" in messages[3] and "None or NaN" not in messages[3]


@pytest.mark.timeout(120)
def test_no_server_at_start_is_announced_within_seconds_then_waited_for(tmp_path, caplog):
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    trainer = AsyncGRPOTrainer(
        model=MODEL, reward_funcs=spread_reward, train_dataset=arithmetic.make_dataset(8, seed=0),
        args=short_run_config(tmp_path / "out", url, max_steps=1, vllm_server_timeout=6),
    )
    notices = []

    class Spy(logging.Handler):
        def emit(self, record):
            if "waiting for the inference server" in record.getMessage():
                notices.append((time.monotonic(), record.getMessage()))

    spy = Spy()
    logging.getLogger("asyncgrpo").addHandler(spy)
    t0 = time.monotonic()
    try:
        # the link's own timeout must not hide the client's error, which says what /health last answered
        with pytest.raises(TimeoutError, match=r"last /health: .*vllm_server_timeout"):
            trainer.train()
    finally:
        logging.getLogger("asyncgrpo").removeHandler(spy)
    assert notices, "nothing said that the trainer waits for the server"
    first_at, message = notices[0]
    assert first_at - t0 < 4.0 and url in message and "vllm_server_timeout=6" in message
    assert time.monotonic() - t0 >= 6  # it kept waiting until the timeout


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_token_budget_no_sample_fits_stops_the_run_instead_of_dropping_forever(tmp_path, server):
    """Every sample is longer than the budget: each is dropped (said once), and after OVERSIZE_LIMIT of them
    with none taken the run stops saying how large the budget must be, where before it waited forever."""
    from datasets import Dataset

    from asyncgrpo.train.rollout_batches import OVERSIZE_LIMIT

    trainer = AsyncGRPOTrainer(
        model=MODEL, reward_funcs=spread_reward,
        train_dataset=Dataset.from_list(arithmetic.make_dataset(400, seed=0)),
        args=short_run_config(tmp_path / "out", server.url, max_steps=3, token_budget=8),
    )
    t0 = time.monotonic()
    with pytest.raises(ValueError,
                       match=rf"the first {OVERSIZE_LIMIT} samples were all longer than token_budget=8 "
                                         r"tokens \(\d+ to (\d+)\) .*raise `token_budget` to at least \1"):
        trainer.train()
    assert trainer.state.global_step == 0 and time.monotonic() - t0 < 120
