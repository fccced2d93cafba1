"""Streaming (server-sent events) on the embedded server's OpenAI routes (server/routes/chat.py,
server/routes/completions.py) through the `openai` SDK, on the bundled tiny model on CPU: the deltas add
up to the answer the same request gets whole, the usage chunk comes when asked, tool calls come as deltas
at the end, stop strings end the stream, and the framing is vLLM's. The plain server of the pool
(tests/conftest.py).
"""

from __future__ import annotations

import json
import os
import urllib.request

import openai
import pytest
from transformers.utils import get_json_schema

from asyncgrpo.tasks.counter import IncrementEnv, user_message

pytestmark = pytest.mark.process

os.environ.setdefault("HF_HUB_OFFLINE", "1")

MODEL = "asyncgrpo/tiny-chat"
QUESTION = [{"role": "user", "content": "What is 12 + 30?"}]


@pytest.fixture
def server(embedded_server):
    return embedded_server(MODEL)  # the pool's plain server: requests leave nothing behind


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)


def _chat_stream(client, **kwargs) -> tuple[dict[int, str], dict[int, list], list]:
    """(content per choice, tool-call deltas per choice, every chunk) of a streamed chat completion."""
    content: dict[int, str] = {}
    calls: dict[int, list] = {}
    chunks = list(client.chat.completions.create(model=MODEL, stream=True, **kwargs))
    for chunk in chunks:
        for choice in chunk.choices:
            content[choice.index] = content.get(choice.index, "") + (choice.delta.content or "")
            calls.setdefault(choice.index, []).extend(choice.delta.tool_calls or [])
    return content, calls, chunks


def test_chat_deltas_add_up_to_the_whole_answer_and_usage_comes_last(client):
    kwargs = {"messages": QUESTION, "max_tokens": 30, "seed": 21, "n": 2, "temperature": 1.5}
    whole = client.chat.completions.create(model=MODEL, **kwargs)
    content, _, chunks = _chat_stream(client, stream_options={"include_usage": True}, **kwargs)
    assert content == {c.index: c.message.content for c in whole.choices}
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    firsts = [c.choices[0] for c in chunks[:2]]
    assert [(f.index, f.delta.role) for f in firsts] == [(0, "assistant"), (1, "assistant")]
    finishes = {c.choices[0].index: c.choices[0].finish_reason
                for c in chunks[:-1] if c.choices[0].finish_reason}
    assert finishes == {c.index: c.finish_reason for c in whole.choices}
    assert chunks[-1].choices == [] and chunks[-1].usage.model_dump() == {
        **whole.usage.model_dump(), "prompt_tokens_details": None, "completion_tokens_details": None}
    _, _, plain = _chat_stream(client, **kwargs)
    assert all(c.usage is None for c in plain)


def test_chat_stream_carries_logprobs_and_token_ids_per_token(client):
    kwargs = {"messages": QUESTION, "max_tokens": 12, "seed": 4, "logprobs": True, "top_logprobs": 2,
              "extra_body": {"return_token_ids": True}}
    whole = client.chat.completions.create(model=MODEL, **kwargs)
    _, _, chunks = _chat_stream(client, **kwargs)
    assert chunks[0].model_extra["prompt_token_ids"] == whole.model_extra["prompt_token_ids"]
    ids = [t for c in chunks[1:] for t in c.choices[0].model_extra.get("token_ids") or []]
    assert ids == whole.choices[0].model_extra["token_ids"]
    streamed = [e.model_dump()
                for c in chunks[1:] if c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert streamed == [e.model_dump() for e in whole.choices[0].logprobs.content]


def test_chat_stream_with_stop_string_ends_where_the_whole_answer_does(client):
    base = {"messages": QUESTION, "max_tokens": 30, "seed": 11, "extra_body": {"ignore_eos": True}}
    text = client.chat.completions.create(model=MODEL, **base).choices[0].message.content
    stop = text[len(text) // 2: len(text) // 2 + 3]
    whole = client.chat.completions.create(model=MODEL, stop=stop, **base)
    content, _, chunks = _chat_stream(client, stop=stop, **base)
    assert content[0] == whole.choices[0].message.content == text[: text.index(stop)]
    last = chunks[-1].choices[0]
    assert last.finish_reason == "stop" and last.model_extra["stop_reason"] == stop


def test_chat_stream_with_tools_ends_with_the_tool_call_deltas(client):
    tools = [get_json_schema(IncrementEnv().increment)]
    kwargs = {"messages": [{"role": "user", "content": user_message(13, 5)}], "tools": tools,
              "max_tokens": 60, "seed": 0}
    whole = client.chat.completions.create(model=MODEL, **kwargs)
    content, calls, chunks = _chat_stream(client, **kwargs)
    expected = whole.choices[0].message.tool_calls
    assert [(c.index, c.type, c.function.name, json.loads(c.function.arguments)) for c in calls[0]] == [
        (i, "function", e.function.name, json.loads(e.function.arguments)) for i, e in enumerate(expected)]
    assert chunks[-1].choices[0].finish_reason == "tool_calls" and chunks[-1].choices[0].delta.tool_calls
    assert content[0] == (whole.choices[0].message.content or "")


def test_completions_stream_adds_up_to_the_whole_text_with_usage(client):
    kwargs = {"prompt": ["The counter", "Bring the"], "max_tokens": 16, "seed": 3, "n": 2, "logprobs": 1}
    whole = client.completions.create(model=MODEL, **kwargs)
    chunks = list(client.completions.create(model=MODEL, stream=True, stream_options={"include_usage": True},
                                            **kwargs))
    texts: dict[int, str] = {}
    tokens: dict[int, list] = {}
    for chunk in chunks[:-1]:
        (choice,) = chunk.choices
        texts[choice.index] = texts.get(choice.index, "") + choice.text
        tokens.setdefault(choice.index, []).extend(choice.logprobs.tokens)
    assert texts == {c.index: c.text for c in whole.choices}
    assert tokens == {c.index: c.logprobs.tokens for c in whole.choices}
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert all(c.object == "text_completion" for c in chunks)


def test_completions_stop_strings_whole_and_streamed(client):
    base = {"prompt": "What is 12 + 30?", "max_tokens": 24, "seed": 8, "extra_body": {"ignore_eos": True}}
    text = client.completions.create(model=MODEL, **base).choices[0].text
    stop = text[len(text) // 2: len(text) // 2 + 2]
    whole = client.completions.create(model=MODEL, stop=[stop], **base)
    assert whole.choices[0].text == text[: text.index(stop)]
    assert (whole.choices[0].finish_reason, whole.choices[0].model_extra["stop_reason"]) == ("stop", stop)
    chunks = client.completions.create(model=MODEL, stop=[stop], stream=True, **base)
    streamed = "".join(c.choices[0].text for c in chunks)
    assert streamed == whole.choices[0].text


def test_sse_framing_is_data_lines_then_done(server):
    body = {"model": MODEL, "messages": QUESTION, "max_tokens": 4, "seed": 1, "stream": True}
    request = urllib.request.Request(server.url + "/v1/chat/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        assert response.headers["Content-Type"].startswith("text/event-stream")
        events = response.read().decode().split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    assert all(e.startswith("data: {") for e in events[:-2])
    first = json.loads(events[0][len("data: "):])
    assert first["choices"] == [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                 "finish_reason": None}]
