"""data/tool_calls.py: the OpenAI wire form of tools and calls <-> the chat-template form, and parsing a
generated turn back into calls, which the rollout loop and the server's /v1/chat/completions share;
data/chat_templates.supports_tools."""

from __future__ import annotations

import json

import pytest

from asyncgrpo.data.chat_templates import REFERENCE_TOOLS, supports_tools
from asyncgrpo.data.tool_calls import calls_from_wire, calls_to_wire, check_tools, parse_assistant_message
from asyncgrpo.modeling.load import load_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("asyncgrpo/tiny-chat")


def test_wire_calls_round_trip_through_the_template_form():
    wire = [{"id": "call_1", "type": "function",
             "function": {"name": "calculator", "arguments": '{"expression": "2 + 3", "exact": true}'}}]
    template = calls_from_wire(wire)
    arguments = {"expression": "2 + 3", "exact": True}
    function = {"name": "calculator", "arguments": arguments}
    assert template == [{"type": "function", "id": "call_1", "function": function}]
    back = calls_to_wire(template, ["call_1"])
    assert back[0]["id"] == "call_1" and json.loads(back[0]["function"]["arguments"]) == json.loads(
        wire[0]["function"]["arguments"])
    assert calls_from_wire([{"function": {"name": "f", "arguments": ""}}])[0]["function"]["arguments"] == {}


@pytest.mark.parametrize(("calls", "error"), [
    ("not a list", "must be a list"),
    ([{"function": {"arguments": "{}"}}], "tool_calls[0] must be"),
    ([{"function": {"name": "f", "arguments": "{bad"}}], "is not JSON"),
    ([{"function": {"name": "f", "arguments": "[1, 2]"}}], "must be a JSON object"),
])
def test_malformed_wire_calls_are_refused_with_the_expected_shape(calls, error):
    with pytest.raises(ValueError, match=error.replace("[", r"\[").replace("]", r"\]")):
        calls_from_wire(calls)


def test_check_tools_names_the_malformed_tool():
    assert check_tools(REFERENCE_TOOLS) == REFERENCE_TOOLS
    with pytest.raises(ValueError, match=r"tools\[1\]\.function\.name"):
        check_tools([*REFERENCE_TOOLS, {"type": "function", "function": {"description": "x"}}])
    with pytest.raises(ValueError, match=r"tools\[0\] must be"):
        check_tools([{"type": "retrieval"}])


def test_a_parsed_turn_becomes_wire_calls_with_json_arguments(tokenizer):
    text = '<tool_call>\n{"name": "increment", "arguments": {"step": 5}}\n</tool_call>'
    message = parse_assistant_message(tokenizer, text)
    wire = calls_to_wire(message["tool_calls"], ["id-0"])
    assert wire == [{"id": "id-0", "type": "function",
                     "function": {"name": "increment", "arguments": '{"step": 5}'}}]
    assert message["content"] == ""


def test_supports_tools_reads_the_template(tokenizer):
    assert supports_tools(tokenizer)

    class Plain:
        chat_template = "{% for m in messages %}{{ m.content }}{% endfor %}"

    assert not supports_tools(Plain()) and not supports_tools(object())
