"""/v1/chat/completions of the embedded server (server/routes/chat.py) on the bundled tiny model, on CPU:
vLLM 0.33's response shape (the real server's answer in tests/fixtures/vllm), and the `openai` SDK against
it: tool calls parsed back and a follow-up turn with the tool result, n, seeds, log-probs, lengths, stop
strings, token ids, and the errors of bad requests. The plain server of the pool (tests/conftest.py).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import openai
import pytest
from transformers.utils import get_json_schema

from asyncgrpo.modeling.load import load_tokenizer
from asyncgrpo.tasks.counter import IncrementEnv, user_message

pytestmark = pytest.mark.process

os.environ.setdefault("HF_HUB_OFFLINE", "1")

MODEL = "asyncgrpo/tiny-chat"
FIXTURE = Path(__file__).resolve().parents[2] / "fixtures" / "vllm" / "protocol-0.33.0.json"
TOOLS = [get_json_schema(IncrementEnv().increment)]  # the schema the tiny model was trained with
QUESTION = [{"role": "user", "content": "What is 12 + 30?"}]


@pytest.fixture
def server(embedded_server):
    return embedded_server(MODEL)  # the pool's plain server: requests leave nothing behind


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(MODEL)


def _post(server, path: str, body: dict) -> tuple[int, dict]:
    import urllib.error
    import urllib.request

    request = urllib.request.Request(server.url + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def _assert_same_shape(ours, ref, where="$"):
    """Every key of `ref` is in `ours`, with the same JSON type, recursively (null matches anything)."""
    if ref is None or ours is None:
        return
    if isinstance(ref, dict):
        assert isinstance(ours, dict), where
        missing = set(ref) - set(ours)
        assert not missing, (where, missing)
        for key in ref:
            _assert_same_shape(ours[key], ref[key], f"{where}.{key}")
    elif isinstance(ref, list):
        assert isinstance(ours, list), where
        if ref and ours:
            _assert_same_shape(ours[0], ref[0], f"{where}[0]")
    elif isinstance(ref, (int, float)) and not isinstance(ref, bool):
        assert isinstance(ours, (int, float)) and not isinstance(ours, bool), (where, ours, ref)
    else:
        assert type(ours) is type(ref), (where, ours, ref)


def test_the_response_has_every_field_of_vllms_with_the_same_types(server):
    case = json.loads(FIXTURE.read_text())["chat"]
    status, body = _post(server, case["path"], {**case["request"], "model": MODEL})
    assert status == case["status"] == 200
    _assert_same_shape(body, case["response"])
    assert set(body["choices"][0]["message"]) == set(case["response"]["choices"][0]["message"])
    choice = body["choices"][0]
    num_tokens = body["usage"]["completion_tokens"]
    assert len(choice["token_ids"]) == len(choice["logprobs"]["content"]) == num_tokens
    assert all(len(entry["top_logprobs"]) == 2 for entry in choice["logprobs"]["content"])


def test_sdk_chat_answers_and_seeds_reproduce(client):
    first, second, other = (
        client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=20, seed=seed)
        for seed in (7, 7, 8)
    )
    assert first.object == "chat.completion" and first.model == MODEL
    assert first.choices[0].message.role == "assistant" and first.choices[0].message.content
    assert first.choices[0].message.content == second.choices[0].message.content
    assert first.choices[0].finish_reason in ("stop", "length")
    usage = first.usage
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens and usage.completion_tokens > 0
    assert other.id != first.id


def test_sdk_n_choices_use_seed_plus_index(client):
    both = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=12, seed=3, n=2,
                                          temperature=1.5)
    assert [c.index for c in both.choices] == [0, 1]
    second = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=12, seed=4,
                                            temperature=1.5)
    assert both.choices[1].message.content == second.choices[0].message.content
    with_ids = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=12, seed=3, n=2,
                                              temperature=1.5, extra_body={"return_token_ids": True})
    assert [c.message.content for c in with_ids.choices] == [c.message.content for c in both.choices]
    assert with_ids.usage.completion_tokens == sum(len(c.model_extra["token_ids"]) for c in with_ids.choices)


def test_sdk_logprobs_and_top_logprobs(client):
    out = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=8, seed=1, logprobs=True,
                                         top_logprobs=3, extra_body={"return_token_ids": True})
    choice = out.choices[0]
    content = choice.logprobs.content
    assert len(content) == len(choice.model_extra["token_ids"]) == out.usage.completion_tokens
    for entry in content:
        assert entry.logprob <= 0 and bytes(entry.bytes).decode("utf-8", "replace") == entry.token
        assert len(entry.top_logprobs) == 3 and entry.top_logprobs[0].token == entry.token
        assert entry.top_logprobs[0].logprob == entry.logprob
    without = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=8, seed=1)
    assert without.choices[0].logprobs is None


def test_sdk_max_completion_tokens_bounds_the_answer(client):
    out = client.chat.completions.create(model=MODEL, messages=QUESTION, max_completion_tokens=3, seed=2,
                                         temperature=2.0, extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 3 and out.choices[0].finish_reason == "length"


def test_sdk_stop_strings_cut_the_text_and_end_the_choice(client):
    full = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=30, seed=11,
                                          extra_body={"return_token_ids": True, "ignore_eos": True})
    text = full.choices[0].message.content
    stop = text[len(text) // 3: len(text) // 3 + 2]
    assert stop.strip(), text
    cut = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=30, seed=11, stop=[stop],
                                         extra_body={"return_token_ids": True, "ignore_eos": True})
    choice = cut.choices[0]
    assert choice.message.content == text[: text.index(stop)]
    assert choice.finish_reason == "stop" and choice.model_extra["stop_reason"] == stop
    kept = choice.model_extra["token_ids"]
    assert kept == full.choices[0].model_extra["token_ids"][: len(kept)] and len(kept) < 30
    assert cut.usage.completion_tokens == len(kept)


def test_stop_token_ids_end_the_answer_and_are_kept(client, tokenizer):
    full = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=20, seed=5,
                                          extra_body={"return_token_ids": True, "ignore_eos": True})
    ids = full.choices[0].model_extra["token_ids"]
    stop_id = ids[3]
    cut = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=20, seed=5,
                                         extra_body={"return_token_ids": True, "ignore_eos": True,
                                                     "stop_token_ids": [stop_id]})
    choice = cut.choices[0]
    end = ids.index(stop_id) + 1
    assert choice.model_extra["token_ids"] == ids[:end]
    assert (choice.finish_reason, choice.model_extra["stop_reason"]) == ("stop", stop_id)
    assert choice.message.content == tokenizer.decode(ids[: end - 1], skip_special_tokens=True)


def test_token_ids_are_the_templates_rendering_and_detokenize_to_the_content(client, tokenizer):
    messages = [{"role": "system", "content": "Be brief."}, *QUESTION]
    out = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=20, seed=9,
                                         extra_body={"return_token_ids": True})
    expected = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)["input_ids"]
    assert out.model_extra["prompt_token_ids"] == list(expected)
    assert out.usage.prompt_tokens == len(expected)
    ids = out.choices[0].model_extra["token_ids"]
    assert tokenizer.decode(ids, skip_special_tokens=True) == out.choices[0].message.content


def test_template_kwargs_and_continuing_the_final_message(client, tokenizer):
    partial = [*QUESTION, {"role": "assistant", "content": "12 + 30"}]
    out = client.chat.completions.create(
        model=MODEL, messages=partial, max_tokens=5, seed=1,
        extra_body={"return_token_ids": True, "add_generation_prompt": False, "continue_final_message": True,
                    "chat_template_kwargs": {"enable_thinking": False}})
    expected = tokenizer.apply_chat_template(partial, continue_final_message=True, tokenize=True)["input_ids"]
    assert out.model_extra["prompt_token_ids"] == list(expected)
    assert tokenizer.decode(expected).endswith("12 + 30")


def test_sdk_tool_call_is_parsed_back_then_the_tool_result_renders(client, tokenizer):
    messages = [{"role": "user", "content": user_message(13, 5)}]
    out = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, max_tokens=60, seed=0)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls"
    call = choice.message.tool_calls[0]
    assert call.type == "function" and call.function.name == "increment" and call.id
    arguments = json.loads(call.function.arguments)
    assert isinstance(arguments["step"], int)

    result = IncrementEnv().increment(arguments["step"])
    follow_up = [*messages, choice.message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": str(result)}]
    nxt = client.chat.completions.create(model=MODEL, messages=follow_up, tools=TOOLS, max_tokens=60, seed=0,
                                         extra_body={"return_token_ids": True})
    prompt = tokenizer.decode(nxt.model_extra["prompt_token_ids"])
    step = arguments["step"]
    rendered_call = f'<tool_call>\n{{"name": "increment", "arguments": {{"step": {step}}}}}\n</tool_call>'
    assert rendered_call in prompt and f"<tool_response>\n{result}\n</tool_response>" in prompt
    answer = nxt.choices[0]
    assert answer.message.tool_calls or answer.message.content


def test_tool_choice_none_renders_tools_without_parsing_calls(client):
    messages = [{"role": "user", "content": user_message(13, 5)}]
    out = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, tool_choice="none",
                                         max_tokens=60, seed=0)
    choice = out.choices[0]
    assert choice.message.tool_calls is None and "<tool_call>" in choice.message.content
    assert choice.finish_reason == "stop"


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"messages": [{"role": "robot", "content": "hi"}]}, "role must be one of"),
    ({"messages": QUESTION, "n": 0}, "n must be at least 1"),
    ({"messages": [{"role": "user", "content": "1 " * 1100}]}, "maximum context length is 1024"),
    ({"messages": QUESTION, "top_logprobs": 2}, "`logprobs` must be set to true"),
    ({"messages": QUESTION, "tools": TOOLS, "tool_choice": "required"}, "no guided decoding"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "only text parts"),
    ({"messages": QUESTION, "extra_body": {"continue_final_message": True}}, "Cannot set both"),
])
def test_sdk_bad_requests_are_400_with_the_reason(client, kwargs, message):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, max_tokens=4, **kwargs)
    assert info.value.status_code == 400 and message in str(info.value)
    assert info.value.body["type"] == "BadRequestError"


def test_unknown_model_is_404_as_vllm_answers(client):
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="gpt-4o", messages=QUESTION, max_tokens=4)
    assert "The model `gpt-4o` does not exist" in str(info.value)
