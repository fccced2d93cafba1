"""The pure parts of rollout/harness_loop.py: what reward functions see of a harness run, and which rollouts
are left out of their group's statistics."""

from __future__ import annotations

import math

import numpy as np

from asyncgrpo.rollout.harness_calls import CHAT_PATH, COMPLETIONS_PATH
from asyncgrpo.rollout.harness_loop import recorded_completion, unscored_without_sequences
from asyncgrpo.rollout.harness_proxy import RecordedCall

CALL = {"id": "call_0", "type": "function", "function": {"name": "increment", "arguments": '{"step": 3}'}}


def test_the_completion_is_the_last_calls_conversation_after_the_task_then_its_reply():
    request = {"messages": [
        {"role": "system", "content": "You are an agent."},
        {"role": "user", "content": "Bring the counter to 3."},
        {"role": "assistant", "content": "", "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "call_0", "content": "3"},
    ]}
    reply = {"choices": [
        {"message": {"role": "assistant", "content": "The counter is at 3.", "refusal": None}}
    ]}
    completion = recorded_completion(RecordedCall(CHAT_PATH, request, reply, []))
    assert completion == [
        {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "increment", "arguments": {"step": 3}},
             "id": "call_0"}]},
        {"role": "tool", "tool_call_id": "call_0", "content": "3"},
        {"role": "assistant", "content": "The counter is at 3."},
    ]


def test_a_completions_call_gives_its_text_as_one_assistant_message():
    reply = {"choices": [{"text": " 42", "index": 0}]}
    assert recorded_completion(RecordedCall(COMPLETIONS_PATH, {"prompt": "12 + 30 ="}, reply, [])) == [
        {"role": "assistant", "content": " 42"}]


def test_rollouts_without_a_training_sequence_are_unscored():
    rewards = np.array([1.0, 0.0, 0.5])
    out = unscored_without_sequences(rewards, [["seq"], [], ["seq", "seq"]])
    assert out[0] == 1.0 and math.isnan(out[1]) and out[2] == 0.5
    assert rewards[1] == 0.0  # the input is not modified
