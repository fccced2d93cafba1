"""Tests for asyncgrpo.data.chat_templates: prefix-preserving check, bundled templates, tool-call parsing.

The official-style templates in tests/fixtures/chat_templates/ reproduce each family's published format;
the tokenizers are byte-level BPE built in-process with the family's special tokens (nothing downloaded).
"""

import json
import logging
from pathlib import Path

import pytest
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from asyncgrpo.data.chat_templates import (
    FAMILIES,
    REFERENCE_TOOLS,
    detect_family,
    is_prefix_preserving,
    prepare_chat_template,
    reference_conversation,
    training_template,
)
from asyncgrpo.data.tool_calls import ToolCallParseError, parse_assistant_message, parse_tool_calls
from asyncgrpo.modeling import load as bundled_models

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "chat_templates"


def ds(name: str) -> str:
    """A DeepSeek-V3 special token, e.g. ds("tool sep") (fullwidth bars, lower-block spaces)."""
    return "<\uff5c" + name.replace(" ", "\u2581") + "\uff5c>"


QWEN_SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
QWEN_TEXT = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]
LLAMA_SPECIAL = [
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|python_tag|>",
]
DS_SPECIAL = [
    ds(n)
    for n in (
        "begin of sentence",
        "end of sentence",
        "User",
        "Assistant",
        "tool calls begin",
        "tool calls end",
        "tool call begin",
        "tool call end",
        "tool sep",
        "tool outputs begin",
        "tool outputs end",
        "tool output begin",
        "tool output end",
    )
]
EOS = {
    "qwen3": "<|im_end|>",
    "qwen2_5": "<|im_end|>",
    "llama3": "<|eot_id|>",
    "deepseek_v3": ds("end of sentence"),
}


def build_tokenizer(special, text_tokens=(), merges=(), template=None, **tokens) -> PreTrainedTokenizerFast:
    """Byte-level BPE over the 256 byte symbols (plus `merges`), with added special and text tokens."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {c: i for i, c in enumerate(alphabet)}
    for a, b in merges:
        vocab[a + b] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=list(merges)))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in text_tokens])
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, **tokens)
    hf.chat_template = template
    return hf


def family_tokenizer(family: str, template: str | None = None) -> PreTrainedTokenizerFast:
    """A tokenizer with `family`'s special tokens and its official-style template (or `template`)."""
    template = template if template is not None else (FIXTURES / f"{family}.jinja").read_text()
    if family == "qwen3":
        return build_tokenizer(
            QWEN_SPECIAL,
            QWEN_TEXT + ["<think>", "</think>"],
            template=template,
            eos_token="<|im_end|>",
            pad_token="<|endoftext|>",
        )
    if family == "qwen2_5":
        return build_tokenizer(
            QWEN_SPECIAL, QWEN_TEXT, template=template, eos_token="<|im_end|>", pad_token="<|endoftext|>"
        )
    if family == "llama3":
        return build_tokenizer(
            LLAMA_SPECIAL, template=template, bos_token="<|begin_of_text|>", eos_token="<|eot_id|>"
        )
    if family == "deepseek_v3":
        return build_tokenizer(
            DS_SPECIAL, template=template, bos_token=DS_SPECIAL[0], eos_token=DS_SPECIAL[1]
        )
    raise AssertionError(family)


def render(tokenizer, messages, generation_prompt=False, **kwargs) -> str:
    return tokenizer.apply_chat_template(
        messages, tools=REFERENCE_TOOLS, add_generation_prompt=generation_prompt, tokenize=False, **kwargs
    )


def call(expression, as_string=False):
    arguments = {"expression": expression}
    return [
        {
            "type": "function",
            "function": {
                "name": "calculator",
                "arguments": json.dumps(arguments) if as_string else arguments,
            },
        }
    ]


# ------------------------------------------------------------------------------ prefix-preserving check


def test_official_qwen3_template_is_not_prefix_preserving_it_drops_earlier_think():
    ok, reason = is_prefix_preserving(family_tokenizer("qwen3"))
    assert not ok
    assert "appending message 5 (user)" in reason
    assert "message 2 (assistant)" in reason
    assert "I should use the calculator." in reason  # the text around the divergence is shown


def test_official_qwen3_without_thinking_breaks_on_the_first_tool_result():
    ok, reason = is_prefix_preserving(family_tokenizer("qwen3"), {"enable_thinking": False})
    assert not ok
    assert "appending message 3 (tool)" in reason
    assert "<think>\\n\\n</think>" in reason  # the empty block the last message had, gone once it is not last


def test_official_deepseek_v3_template_cannot_render_dict_arguments():
    ok, reason = is_prefix_preserving(family_tokenizer("deepseek_v3"))
    assert not ok
    assert "raised TypeError" in reason and "message 2, assistant with tool_calls" in reason


@pytest.mark.parametrize("family", ["qwen2_5", "llama3"])
def test_official_qwen2_5_and_llama3_templates_are_prefix_preserving(family):
    assert is_prefix_preserving(family_tokenizer(family)) == (True, "")


@pytest.mark.parametrize("kwargs", [{}, {"enable_thinking": False}])
@pytest.mark.parametrize("family", FAMILIES)
def test_bundled_training_templates_are_prefix_preserving(family, kwargs):
    tokenizer = family_tokenizer(family, training_template(family))
    assert is_prefix_preserving(tokenizer, kwargs) == (True, "")


def test_a_text_prefix_whose_tokens_merge_across_the_boundary_is_reported():
    template = (
        "{%- for m in messages %}{{ '\\n' + m.role + ': ' + (m.content or '') + '\\n' }}{%- endfor %}"
        "{%- if add_generation_prompt %}{{ '\\nassistant: ' }}{%- endif %}"
    )
    assert is_prefix_preserving(build_tokenizer(QWEN_SPECIAL, template=template)) == (True, "")
    merged = build_tokenizer(
        QWEN_SPECIAL, merges=[("\u010a", "\u010a")], template=template
    )  # "\n\n" is one token
    ok, reason = is_prefix_preserving(merged)
    assert not ok
    assert "keeps the text but changes the tokens" in reason


def test_a_tokenizer_without_chat_template_is_not_prefix_preserving():
    assert is_prefix_preserving(build_tokenizer(QWEN_SPECIAL)) == (
        False,
        "the tokenizer has no chat_template",
    )


# ---------------------------------------------------------------------------------- family detection


@pytest.mark.parametrize("family", FAMILIES)
def test_detect_family_of_official_and_bundled_templates(family):
    assert detect_family(family_tokenizer(family)) == family
    assert detect_family(family_tokenizer(family, training_template(family))) == family


def test_detect_family_is_none_for_other_templates():
    assert (
        detect_family(family_tokenizer("qwen2_5", (FIXTURES / "drops_old_tool_results.jinja").read_text()))
        is None
    )
    llama3_0 = ("{% for m in messages %}{{ '<|start_header_id|>' + m.role + '<|end_header_id|>\\n\\n' + "
                "m.content }}{% endfor %}")
    assert detect_family(family_tokenizer("llama3", llama3_0)) is None  # Llama 3.0: no tool format
    # DeepSeek's tokens without its template, and its template text without its tokens
    assert detect_family(family_tokenizer("deepseek_v3", "{{ messages[0].content }}")) is None
    assert detect_family(family_tokenizer("qwen2_5", (FIXTURES / "deepseek_v3.jinja").read_text())) is None


def test_training_template_of_an_unknown_family_raises():
    with pytest.raises(ValueError, match="no bundled training template for family 'mistral'"):
        training_template("mistral")


# ------------------------------------------------------------------------------- prepare_chat_template


@pytest.mark.parametrize("family", ["qwen3", "deepseek_v3"])
def test_prepare_switches_a_known_family_to_its_training_template(family, caplog):
    tokenizer = family_tokenizer(family)
    with caplog.at_level(logging.WARNING, logger="asyncgrpo.data.chat_templates"):
        assert prepare_chat_template(tokenizer, tools_enabled=True, chat_template_kwargs={}) == family
    assert tokenizer.chat_template == training_template(family)
    assert is_prefix_preserving(tokenizer) == (True, "")
    assert "not prefix-preserving" in caplog.text and f"bundled {family} training template" in caplog.text


def test_prepare_switches_qwen3_in_non_thinking_mode_too():
    tokenizer = family_tokenizer("qwen3")
    assert (
        prepare_chat_template(tokenizer, tools_enabled=True, chat_template_kwargs={"enable_thinking": False})
        == "qwen3"
    )
    assert is_prefix_preserving(tokenizer, {"enable_thinking": False}) == (True, "")


@pytest.mark.parametrize("family", ["qwen2_5", "llama3"])
def test_prepare_keeps_a_prefix_preserving_template(family):
    tokenizer = family_tokenizer(family)
    before = tokenizer.chat_template
    assert prepare_chat_template(tokenizer, tools_enabled=True, chat_template_kwargs=None) is None
    assert tokenizer.chat_template == before


def test_prepare_does_nothing_without_tools():
    tokenizer = family_tokenizer("qwen3")
    before = tokenizer.chat_template
    assert prepare_chat_template(tokenizer, tools_enabled=False, chat_template_kwargs={}) is None
    assert tokenizer.chat_template == before


def test_prepare_raises_a_clear_error_for_an_unknown_non_preserving_template():
    tokenizer = family_tokenizer("qwen2_5", (FIXTURES / "drops_old_tool_results.jinja").read_text())
    with pytest.raises(ValueError) as info:
        prepare_chat_template(tokenizer, tools_enabled=True, chat_template_kwargs={})
    message = str(info.value)
    assert "not prefix-preserving" in message
    assert "message 3 (tool)" in message and "[tool result omitted]" in message  # the divergence
    assert "processing_class" in message and "chat_template" in message  # the fix


def test_prepare_refuses_to_switch_a_variant_the_bundled_template_does_not_reproduce():
    # A DeepSeek template whose generation prompt also opens the reasoning (R1 style)
    variant = (
        (FIXTURES / "deepseek_v3.jinja")
        .read_text()
        .replace("{{ ASSISTANT }}{% endif %}", "{{ ASSISTANT + '<think>\\n' }}{% endif %}")
    )
    tokenizer = family_tokenizer("deepseek_v3", variant)
    assert detect_family(tokenizer) == "deepseek_v3"
    with pytest.raises(ValueError) as info:
        prepare_chat_template(tokenizer, tools_enabled=True, chat_template_kwargs={})
    assert "renders the first prompt differently" in str(info.value) and "<think>" in str(info.value)
    assert tokenizer.chat_template == variant  # left as it was


# ------------------------------------------------------------- bundled versus official renderings


def family_conversation(family):
    """One tool round in the style the family's model writes: Qwen3 reasons in every turn; Qwen2.5 and
    Llama 3.1 call tools without content; DeepSeek-V3's official template needs string arguments."""
    if family == "qwen3":
        first = {
            "role": "assistant",
            "content": "<think>\nUse the tool.\n</think>\n\n",
            "tool_calls": call("17 * 23"),
        }
        answer = "<think>\nIt returned 391.\n</think>\n\n17 * 23 = 391."
    else:
        first = {
            "role": "assistant",
            "content": "",
            "tool_calls": call("17 * 23", as_string=family == "deepseek_v3"),
        }
        answer = "17 * 23 = 391."
    return [
        {"role": "system", "content": "You are a careful assistant."},
        {"role": "user", "content": "What is 17 * 23?"},
        first,
        {"role": "tool", "name": "calculator", "content": "391"},
        {"role": "assistant", "content": answer},
    ]


@pytest.mark.parametrize("family", FAMILIES)
def test_bundled_templates_render_the_final_turn_like_the_official_ones(family):
    official, bundled = family_tokenizer(family), family_tokenizer(family, training_template(family))
    messages = family_conversation(family)
    for k in range(2, len(messages) + 1):  # each prompt and each final assistant turn
        generation_prompt = k < len(messages) and messages[k]["role"] == "assistant"
        assert render(bundled, messages[:k], generation_prompt) == render(
            official, messages[:k], generation_prompt
        ), k


def test_bundled_qwen3_without_thinking_renders_prompt_and_last_turn_like_the_official_one():
    official, bundled = family_tokenizer("qwen3"), family_tokenizer("qwen3", training_template("qwen3"))
    messages = reference_conversation(thinking=False)
    for k, generation_prompt in ((2, True), (3, False)):
        assert render(bundled, messages[:k], generation_prompt, enable_thinking=False) == render(
            official, messages[:k], generation_prompt, enable_thinking=False
        )


def test_bundled_templates_keep_earlier_reasoning_the_official_ones_drop():
    # Qwen3: the reasoning of the first tool round, once a second user message arrives
    prompt = reference_conversation()[:6]
    assert "I should use the calculator." not in render(family_tokenizer("qwen3"), prompt, True)
    assert "I should use the calculator." in render(
        family_tokenizer("qwen3", training_template("qwen3")), prompt, True
    )
    # DeepSeek-V3: the reasoning of a plain answer (the official template cuts before </think>)
    prompt = [
        {"role": "user", "content": "Hi."},
        {"role": "assistant", "content": "<think>\nA greeting.\n</think>\n\nHello."},
        {"role": "user", "content": "What is 2 + 2?"},
    ]
    assert "A greeting." not in render(family_tokenizer("deepseek_v3"), prompt, True)
    assert "A greeting." in render(
        family_tokenizer("deepseek_v3", training_template("deepseek_v3")), prompt, True
    )


@pytest.mark.parametrize("family", FAMILIES)
def test_a_turn_written_in_the_template_format_parses_back_to_the_same_rendering(family):
    """Generated text -> parse_assistant_message -> re-rendered conversation: unchanged, every turn."""
    tokenizer = family_tokenizer(family, training_template(family))
    messages = reference_conversation()
    for k, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        prompt = render(tokenizer, messages[:k], True)
        full = render(tokenizer, messages[: k + 1])
        assert full.startswith(prompt)
        output = full[len(prompt) :].split(EOS[family])[0]  # what the model generated, EOS removed
        parsed = parse_assistant_message(tokenizer, output, prefix=prompt)
        assert bool(parsed.get("tool_calls")) == bool(message.get("tool_calls"))
        assert render(tokenizer, [*messages[:k], parsed]) == full, (k, output)


@pytest.mark.parametrize("family", FAMILIES)
def test_bundled_generation_markers_cover_exactly_what_the_model_generated(family):
    tokenizer = family_tokenizer(family, training_template(family))
    messages = reference_conversation()
    expected = []
    for k, message in enumerate(messages):
        if message["role"] == "assistant":
            prompt, full = render(tokenizer, messages[:k], True), render(tokenizer, messages[: k + 1])
            expected.append(full[len(prompt) :].split(EOS[family])[0] + EOS[family])
    out = tokenizer.apply_chat_template(
        messages, tools=REFERENCE_TOOLS, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
    )
    spans, current = [], []
    for token, masked in zip(out["input_ids"], out["assistant_masks"]):
        if masked:
            current.append(token)
        elif current:
            spans.append(tokenizer.decode(current))
            current = []
    assert spans == expected


# -------------------------------------------------------------------------------------- tool calls


def test_parse_qwen_tool_calls_in_order_with_content():
    tokenizer = family_tokenizer("qwen3")
    text = (
        '<think>\nTwo lookups.\n</think>\n\nChecking.\n<tool_call>\n{"name": "a", "arguments": {"x": 1}}\n'
        '</tool_call>\n<tool_call>\n{"name": "b", "arguments": "{\\"y\\": [2]}"}\n</tool_call>'
    )
    message = parse_assistant_message(tokenizer, text)
    assert message["content"] == "<think>\nTwo lookups.\n</think>\n\nChecking."
    assert parse_tool_calls(tokenizer, text) == [
        {"type": "function", "function": {"name": "a", "arguments": {"x": 1}}},
        {"type": "function", "function": {"name": "b", "arguments": {"y": [2]}}},
    ]


def test_parse_without_calls_keeps_the_text():
    tokenizer = family_tokenizer("qwen2_5")
    assert parse_tool_calls(tokenizer, "The answer is \\boxed{4}.") == []
    assert parse_assistant_message(tokenizer, "The answer is \\boxed{4}.") == {
        "role": "assistant",
        "content": "The answer is \\boxed{4}.",
    }
    # an unclosed block (output cut at max tokens) is text, not a call
    assert parse_tool_calls(tokenizer, '<tool_call>\n{"name": "a", "argu') == []


def test_malformed_calls_raise_with_the_well_formed_ones_attached():
    tokenizer = family_tokenizer("qwen3")
    text = (
        '<tool_call>{"name": "a", "arguments": {}}</tool_call><tool_call>{not json}</tool_call>'
        '<tool_call>[1, 2]</tool_call><tool_call>{"name": "b", "arguments": 3}</tool_call>'
    )
    with pytest.raises(ToolCallParseError) as info:
        parse_tool_calls(tokenizer, text)
    error = info.value
    assert isinstance(error, ValueError)
    assert error.calls == [{"type": "function", "function": {"name": "a", "arguments": {}}}]
    assert error.partial == {"role": "assistant", "content": "", "tool_calls": error.calls}
    assert len(error.errors) == 3
    assert "could not parse the tool call as JSON" in error.errors[0] and "{not json}" in error.errors[0]
    assert '"name": <string>, "arguments": <object>' in error.errors[2]
    assert "(and 2 more)" in str(error)


def test_parse_llama3_calls():
    tokenizer = family_tokenizer("llama3")
    text = '<|python_tag|>{"name": "a", "parameters": {"x": 1}}; {"name": "b", "parameters": {"y": "z"}}'
    message = parse_assistant_message(tokenizer, text)
    assert message["content"] == ""
    assert [c["function"] for c in message["tool_calls"]] == [
        {"name": "a", "arguments": {"x": 1}},
        {"name": "b", "arguments": {"y": "z"}},
    ]
    assert parse_tool_calls(tokenizer, "Paris is the capital of France.") == []
    with pytest.raises(ToolCallParseError, match="could not parse the tool call as JSON"):
        parse_tool_calls(tokenizer, '{"name": "a", "parameters": {"x": }')


def test_parse_deepseek_v3_calls():
    tokenizer = family_tokenizer("deepseek_v3")
    text = (
        f"Let me look.{ds('tool calls begin')}{ds('tool call begin')}function{ds('tool sep')}a\n```json\n"
        f'{{"x": 1}}\n```{ds("tool call end")}\n{ds("tool call begin")}function{ds("tool sep")}b\n```json\n'
        f"{{}}\n```{ds('tool call end')}{ds('tool calls end')}"
    )
    message = parse_assistant_message(tokenizer, text)
    assert message["content"] == "Let me look."
    assert [c["function"] for c in message["tool_calls"]] == [
        {"name": "a", "arguments": {"x": 1}},
        {"name": "b", "arguments": {}},
    ]
    bad = (f"{ds('tool calls begin')}{ds('tool call begin')}function{ds('tool sep')}a\n```json\n{{x}}\n```"
           f"{ds('tool call end')}")
    with pytest.raises(ToolCallParseError, match="not JSON"):
        parse_tool_calls(tokenizer, bad)
    with pytest.raises(ToolCallParseError, match="DeepSeek tool call must be"):
        parse_tool_calls(
            tokenizer, f"{ds('tool calls begin')}{ds('tool call begin')}a(x=1){ds('tool call end')}"
        )


RESPONSE_TEMPLATE = {
    "version": 1,
    "start_anchor": "<|im_start|>assistant\n",
    "defaults": {"role": "assistant"},
    "fields": {
        "content": {},
        "reasoning_content": {"open": "<think>", "close": "</think>"},
        "tool_calls": {"open": "<tool_call>", "close": "</tool_call>", "content": "json", "repeats": True},
    },
}


def test_parse_uses_the_tokenizer_response_template_when_it_has_one():
    tokenizer = family_tokenizer("qwen2_5")
    if not hasattr(tokenizer, "parse_response"):
        pytest.skip("this transformers version has no response parsing")
    tokenizer.response_template = RESPONSE_TEMPLATE
    # "<think>" is not parsed by the Qwen2.5 fallback, so the split reasoning proves the parser ran
    text = '<think>plan</think>Done.<tool_call>{"name": "a", "arguments": {"x": 1}}</tool_call>'
    message = parse_assistant_message(tokenizer, text, prefix="<|im_start|>assistant\n")
    assert message["reasoning_content"] == "plan"
    assert message["content"] == "Done."
    assert message["tool_calls"] == [{"type": "function", "function": {"name": "a", "arguments": {"x": 1}}}]
    with pytest.raises(ToolCallParseError, match="response parser"):
        parse_tool_calls(tokenizer, "<tool_call>{not json}</tool_call>", prefix="")


# --------------------------------------------------------------------------------- bundled tiny model


def test_bundled_tiny_model_template_is_prefix_preserving_as_is():
    try:
        bundled_models.resolve_model_path("asyncgrpo/tiny-chat")
    except FileNotFoundError:
        pytest.skip(
            "asyncgrpo/tiny-chat is not built in this checkout (src/asyncgrpo/assets/tiny_chat/ is "
            "missing; scripts/build_tiny_model.py makes it)"
        )
    tokenizer = bundled_models.load_tokenizer("asyncgrpo/tiny-chat")
    before = tokenizer.chat_template
    for kwargs in ({}, {"enable_thinking": False}):
        assert is_prefix_preserving(tokenizer, kwargs) == (True, "")
        assert prepare_chat_template(tokenizer, tools_enabled=True, chat_template_kwargs=kwargs) is None
    assert tokenizer.chat_template == before
