"""/v1/chat/completions requests: the messages and tools a client sends -> the prompt the served model's
chat template renders; a generated text -> the assistant message, its tool calls parsed back.

    body --parse_chat_request--> ChatRequest (template-form messages, tools, template kwargs, stop strings)
         --render_prompt: tokenizer.apply_chat_template, then its tokens (no special tokens added)--> prompt
    generated text --assistant_message: data/tool_calls.py, the model family's format--> content, tool_calls

Request fields and checks follow vLLM 0.33's `ChatCompletionRequest`; the sampling fields go on to
`protocol.parse_sampling` (route "chat"). What the embedded server cannot do is refused with a 400 that
says so: `tool_choice` "required" or a named function (vLLM forces them with guided decoding), non-text
content parts, `response_format` other than text, a request's own `chat_template`, beam search, `echo`.
Tool calls are parsed whenever `tools` are given and `tool_choice` is "auto" (vLLM also needs
`--enable-auto-tool-choice --tool-call-parser`; here the parser is the model family's). A call that does not
parse leaves the whole text as content, as vLLM's parsers do. Pure but for the tokenizer's calls.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

from jinja2 import TemplateError

from asyncgrpo.data.chat_templates import supports_tools
from asyncgrpo.data.tool_calls import (
    ToolCallParseError,
    calls_from_wire,
    check_tools,
    parse_assistant_message,
)
from asyncgrpo.server.protocol import ApiError, stop_strings

ROLES = ("system", "developer", "user", "assistant", "tool")
# arguments of apply_chat_template that chat_template_kwargs may not set (the request has fields for them)
_RESERVED_KWARGS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors",
    "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs", "processor_kwargs",
})
_UNSUPPORTED = (  # (field, value that is fine, why it is refused)
    ("echo", False, "the embedded server does not echo the last message"),
    ("use_beam_search", False, "the embedded server has no beam search"),
    ("prompt_logprobs", None, "the embedded server gives no prompt log-probs"),
    ("chat_template", None, "the embedded server renders with the model's own chat template"),
)


def _bad(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param=param)


@dataclass(frozen=True)
class ChatRequest:
    """A checked chat request: what the template renders and what the answer is made of."""

    messages: list[dict[str, Any]]  # the chat-template form: text content, tool-call arguments as objects
    tools: list[dict[str, Any]] | None  # rendered by the template
    parse_tools: bool  # tool calls are parsed back (tools given, tool_choice "auto")
    add_generation_prompt: bool
    continue_final_message: bool
    template_kwargs: dict[str, Any]
    stop: tuple[str, ...]
    include_stop_str: bool
    skip_special_tokens: bool
    return_token_ids: bool
    tokens_as_ids: bool  # log-probs name tokens "token_id:N"
    return_weight_versions: bool
    top_logprobs: int | None  # per token: None = no log-probs
    sampling: dict[str, Any]  # the SamplingParams fields, for protocol.parse_sampling


def parse_chat_request(body: dict[str, Any]) -> ChatRequest:
    """Check a /v1/chat/completions body (tools are checked against the template in `render_prompt`)."""
    for key, fine, why in _UNSUPPORTED:
        if body.get(key) not in (None, fine):
            raise _bad(f"{key} is not supported: {why}", key)
    response_format = body.get("response_format")
    if response_format is not None and (not isinstance(response_format, dict)
                                        or response_format.get("type", "text") != "text"):
        raise _bad("response_format other than {\"type\": \"text\"} is not supported: the embedded server "
                   "has no guided decoding", "response_format")
    messages = template_messages(body.get("messages"))
    tools, parse_tools = _tools(body)
    add_generation_prompt = body.get("add_generation_prompt", True)
    continue_final = body.get("continue_final_message", False)
    if add_generation_prompt and continue_final:
        raise _bad("Cannot set both `continue_final_message` and `add_generation_prompt` to True.",
                   "continue_final_message")
    if continue_final and messages[-1]["role"] != "assistant":
        raise _bad("continue_final_message needs the last message to be the assistant's",
                   "continue_final_message")
    kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict):
        raise _bad("chat_template_kwargs must be a JSON object", "chat_template_kwargs")
    clash = sorted(set(kwargs) & _RESERVED_KWARGS)
    if clash:
        raise _bad(f"chat_template_kwargs may not set {clash}: use the request's own fields",
                   "chat_template_kwargs")
    logprobs, top_logprobs = bool(body.get("logprobs") or False), body.get("top_logprobs")
    if top_logprobs is not None:
        if isinstance(top_logprobs, bool) or not isinstance(top_logprobs, int) or top_logprobs < 0:
            raise _bad(f"top_logprobs must be a non-negative integer, got {top_logprobs!r:.40}",
                       "top_logprobs")
        if not logprobs:
            raise _bad("when using `top_logprobs`, `logprobs` must be set to true.", "top_logprobs")
    sampling = {k: v for k, v in body.items() if k not in ("stop", "logprobs", "max_completion_tokens")}
    sampling["logprobs"] = (top_logprobs or 0) if logprobs else None
    if body.get("max_completion_tokens") is not None:
        sampling["max_tokens"] = body["max_completion_tokens"]
    return ChatRequest(
        messages=messages, tools=tools, parse_tools=parse_tools,
        add_generation_prompt=bool(add_generation_prompt), continue_final_message=bool(continue_final),
        template_kwargs=dict(kwargs), stop=stop_strings(body),
        include_stop_str=bool(body.get("include_stop_str_in_output", False)),
        skip_special_tokens=bool(body.get("skip_special_tokens", True)),
        return_token_ids=bool(body.get("return_token_ids", False)),
        tokens_as_ids=bool(body.get("return_tokens_as_token_ids", False)),
        return_weight_versions=bool(body.get("return_weight_versions", False)),
        top_logprobs=sampling["logprobs"], sampling=sampling,
    )


def _tools(body: dict[str, Any]) -> tuple[list[dict] | None, bool]:
    """(the tools the template renders, whether calls are parsed back) of `tools` and `tool_choice`."""
    tools = body.get("tools") or None
    if tools is not None:
        try:
            tools = check_tools(tools)
        except ValueError as exc:
            raise _bad(str(exc), "tools") from None
    choice = body.get("tool_choice")
    if choice is None:
        choice = "auto" if tools else "none"
    if choice in ("required",) or isinstance(choice, dict):
        raise _bad(f"tool_choice {choice!r:.80} is not supported: the embedded server has no guided decoding "
                   "to force a call; use \"auto\" (the model's calls are parsed back) or \"none\"",
                   "tool_choice")
    if choice not in ("auto", "none"):
        raise _bad("tool_choice must be \"auto\", \"none\", \"required\" or a named function, got "
                   f"{choice!r:.80}", "tool_choice")
    if choice == "auto" and not tools and body.get("tool_choice") is not None:
        raise _bad("When using `tool_choice`, `tools` must be set.", "tool_choice")
    return tools, bool(tools) and choice == "auto"


def template_messages(messages: Any) -> list[dict[str, Any]]:
    """OpenAI messages -> the form chat templates take: content as text (text parts joined by newlines),
    tool-call arguments as objects, a tool result's `name` from the call its `tool_call_id` answers."""
    if not isinstance(messages, list) or not messages:
        raise _bad("messages must be a non-empty list of {\"role\", \"content\"} objects", "messages")
    out: list[dict[str, Any]] = []
    call_names: dict[str, str] = {}
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise _bad(f"messages[{i}] must be an object with a role and content", "messages")
        role = message.get("role")
        if role not in ROLES:
            raise _bad(f"messages[{i}].role must be one of {', '.join(ROLES)}; got {role!r:.40}", "messages")
        converted = {k: v for k, v in message.items() if v is not None or k == "content"}
        converted["content"] = _text(message.get("content"), i)
        if role == "assistant" and message.get("tool_calls"):
            try:
                converted["tool_calls"] = calls_from_wire(message["tool_calls"])
            except ValueError as exc:
                raise _bad(f"messages[{i}].{exc}", "messages") from None
            call_names.update((c["id"], c["function"]["name"]) for c in converted["tool_calls"] if "id" in c)
        if role == "tool" and "name" not in converted and message.get("tool_call_id") in call_names:
            converted["name"] = call_names[message["tool_call_id"]]
        out.append(converted)
    return out


def _text(content: Any, i: int) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):
        texts = []
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind != "text" or not isinstance(part.get("text"), str):
                raise _bad(f"messages[{i}].content holds a {kind!r:.40} part; only text parts are supported "
                           "(the embedded server serves text models)", "messages")
            texts.append(part["text"])
        return "\n".join(texts)
    raise _bad(f"messages[{i}].content must be a string or a list of text parts", "messages")


def render_prompt(tokenizer: Any, request: ChatRequest, model: str) -> tuple[str, list[int]]:
    """The prompt text the chat template renders and its token ids (no special tokens added: the template
    writes them), as `apply_chat_template(..., tokenize=True)` gives them.

    Raises:
        ApiError: 400 for a model without a tokenizer or chat template, tools given to a template that
            does not render them, or a conversation the template refuses.
    """
    if tokenizer is None:
        raise _bad(f"the model {model!r} has no tokenizer, so /v1/chat/completions cannot render messages; "
                   "send token ids to /v1/completions or /inference/v1/generate")
    if not getattr(tokenizer, "chat_template", None):
        raise _bad(f"the tokenizer of {model!r} has no chat template, so /v1/chat/completions cannot render "
                   "messages; serve a model whose tokenizer has one, or send prompts to /v1/completions")
    if request.tools and not supports_tools(tokenizer):
        raise _bad(f"tools were given, but the chat template of {model!r} does not render tools (it never "
                   "reads `tools`); leave tools out or serve a model whose template supports tool calling",
                   "tools")
    try:
        text = tokenizer.apply_chat_template(
            copy.deepcopy(request.messages), tools=request.tools, tokenize=False,
            add_generation_prompt=request.add_generation_prompt,
            continue_final_message=request.continue_final_message, **request.template_kwargs,
        )
    except (TemplateError, TypeError, ValueError, KeyError, AttributeError, IndexError) as exc:
        raise _bad(f"the chat template of {model!r} cannot render these messages: "
                   f"{type(exc).__name__}: {exc}", "messages") from None
    text_tokenizer = getattr(tokenizer, "tokenizer", tokenizer)  # a processor wraps its tokenizer
    ids = list(text_tokenizer(text, add_special_tokens=False)["input_ids"])
    if not ids:
        raise _bad("the chat template renders these messages as no token at all", "messages")
    return text, ids


def assistant_message(
    tokenizer: Any, text: str, prompt_text: str, request: ChatRequest
) -> tuple[str | None, list[dict[str, Any]], str | None]:
    """(content, tool calls in the chat-template form, reasoning) of a generated text. Without tool parsing,
    or when a call does not parse: the whole text as content and no calls."""
    if not request.parse_tools:
        return text, [], None
    try:
        message = parse_assistant_message(tokenizer, text, prefix=prompt_text, tools=request.tools)
    except ToolCallParseError:
        return text, [], None
    calls = message.get("tool_calls", [])
    reasoning = next((message[k] for k in ("reasoning_content", "thinking", "reasoning")
                      if isinstance(message.get(k), str)), None)
    content = message.get("content") or ""
    return (content or None) if calls else content, calls, reasoning
