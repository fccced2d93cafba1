"""server/chat.py: a /v1/chat/completions body -> the checked request and the prompt the model's chat
template renders, with the bundled tiny model's tokenizer; what the embedded server refuses, and why."""

from __future__ import annotations

import copy

import pytest

from asyncgrpo.modeling.load import load_tokenizer
from asyncgrpo.server.chat import assistant_message, parse_chat_request, render_prompt, template_messages
from asyncgrpo.server.protocol import ApiError

USER = {"role": "user", "content": "Bring the counter to 7."}
CALL = {"id": "call_9", "type": "function", "function": {"name": "increment", "arguments": '{"step": 5}'}}
TOOL = {"type": "function", "function": {"name": "increment", "parameters": {"type": "object"}}}


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("asyncgrpo/tiny-chat")


def test_openai_messages_become_the_template_form():
    messages = [
        {"role": "system", "content": [{"type": "text", "text": "Be"}, {"type": "text", "text": "brief."}]},
        USER,
        {"role": "assistant", "content": None, "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "call_9", "content": "5"},
    ]
    converted = template_messages(messages)
    assert converted[0]["content"] == "Be\nbrief."
    assert converted[2] == {"role": "assistant", "content": "",
                            "tool_calls": [{"id": "call_9", "type": "function",
                                            "function": {"name": "increment", "arguments": {"step": 5}}}]}
    assert converted[3] == {"role": "tool", "tool_call_id": "call_9", "content": "5", "name": "increment"}


def test_a_tool_conversation_renders_like_the_template_with_template_form_messages(tokenizer):
    body = {"messages": [USER, {"role": "assistant", "content": None, "tool_calls": [CALL]},
                         {"role": "tool", "tool_call_id": "call_9", "content": "5"}], "tools": [TOOL]}
    request = parse_chat_request(copy.deepcopy(body))
    text, ids = render_prompt(tokenizer, request, "tiny")
    expected = tokenizer.apply_chat_template(template_messages(body["messages"]), tools=[TOOL],
                                             add_generation_prompt=True, tokenize=False)
    assert text == expected and text.endswith("<|im_start|>assistant\n")
    assert '{"name": "increment", "arguments": {"step": 5}}' in text
    assert ids == tokenizer(text, add_special_tokens=False)["input_ids"]
    assert request.parse_tools and request.sampling["logprobs"] is None


def test_sampling_fields_are_handed_on_as_vllm_maps_them():
    request = parse_chat_request({"messages": [USER], "logprobs": True, "top_logprobs": 3, "max_tokens": 9,
                                  "max_completion_tokens": 4, "stop": ["a", "", "b", "a"]})
    assert request.sampling["logprobs"] == 3 and request.sampling["max_tokens"] == 4
    assert "stop" not in request.sampling and request.stop == ("a", "b")
    assert parse_chat_request({"messages": [USER], "logprobs": True}).top_logprobs == 0


def test_a_call_that_does_not_parse_leaves_the_text_as_content(tokenizer):
    request = parse_chat_request({"messages": [USER], "tools": [TOOL]})
    text = "<tool_call>\n{not json}\n</tool_call>"
    assert assistant_message(tokenizer, text, "", request) == (text, [], None)
    content, calls, _ = assistant_message(
        tokenizer, 'On it.\n<tool_call>\n{"name": "increment", "arguments": {"step": 2}}\n</tool_call>', "",
        request)
    assert content == "On it." and calls[0]["function"] == {"name": "increment", "arguments": {"step": 2}}
    plain = parse_chat_request({"messages": [USER]})
    assert assistant_message(tokenizer, text, "", plain) == (text, [], None)


@pytest.mark.parametrize(("body", "error"), [
    ({"messages": []}, "non-empty list"),
    ({"messages": [{"role": "function", "content": "x"}]}, "role must be one of"),
    ({"messages": [USER], "tools": [{"type": "function"}]}, "tools[0] must be"),
    ({"messages": [USER], "tool_choice": {"type": "function", "function": {"name": "f"}}, "tools": [TOOL]},
     "no guided decoding"),
    ({"messages": [USER], "tool_choice": "auto"}, "`tools` must be set"),
    ({"messages": [USER], "response_format": {"type": "json_object"}}, "response_format"),
    ({"messages": [USER], "chat_template_kwargs": {"tokenize": True}}, "may not set ['tokenize']"),
    ({"messages": [USER], "add_generation_prompt": False, "continue_final_message": True}, "last message"),
    ({"messages": [USER], "top_logprobs": -1, "logprobs": True}, "non-negative"),
    ({"messages": [USER], "chat_template": "{{ messages }}"}, "model's own chat template"),
    ({"messages": [{"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "f",
                                                                                     "arguments": "{"}}]}]},
     "is not JSON"),
])
def test_bad_requests_are_refused_with_the_reason(body, error):
    with pytest.raises(ApiError) as info:
        parse_chat_request(body)
    assert info.value.status == 400 and error in info.value.message


def test_models_that_cannot_render_the_messages_are_refused_clearly(tokenizer):
    request = parse_chat_request({"messages": [USER]})
    with pytest.raises(ApiError, match="has no tokenizer"):
        render_prompt(None, request, "ids-only")

    class NoTemplate:
        chat_template = None

    with pytest.raises(ApiError, match="has no chat template"):
        render_prompt(NoTemplate(), request, "plain")
    without_tools = copy.copy(tokenizer)
    without_tools.chat_template = "{% for m in messages %}{{ m.content }}{% endfor %}"
    with pytest.raises(ApiError, match="does not render tools") as info:
        render_prompt(without_tools, parse_chat_request({"messages": [USER], "tools": [TOOL]}), "plain")
    assert info.value.status == 400
    broken = copy.copy(tokenizer)
    broken.chat_template = "{{ raise_exception('no system messages') }}"
    with pytest.raises(ApiError, match="cannot render these messages: .*no system messages"):
        render_prompt(broken, request, "tiny")
