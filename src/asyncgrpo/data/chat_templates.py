"""Chat templates for the tool loop: the prefix-preserving check and the bundled training templates.

The tool loop renders the whole conversation before every assistant turn, and a turn extends the sample
held so far only when its prompt starts with those tokens (DESIGN 6). That needs a *prefix-preserving*
chat template: rendering a conversation and then rendering it with more messages appended gives token
ids that start with the first rendering. Some official templates are not: Qwen3's drops the `<think>`
block of earlier turns (and adds an empty one to the last message only); DeepSeek-V3's cannot render
dict tool arguments and re-opens an assistant header after tool outputs. For those families
`prepare_chat_template` switches to a bundled training template (`assets/chat_templates/<family>.jinja`)
that renders tools, tool calls, tool results and the generation prompt like the official one, but
renders every earlier turn as it was written.

Parsing the tool calls of a generated turn is `asyncgrpo.data.tool_calls`.

Callers: the trainer runs
`prepare_chat_template(processing_class, tools_enabled=..., chat_template_kwargs=...)` once, before
the rollout process is spawned (the switched template travels with the pickled tokenizer); the tool
loop builds each turn's assistant message with `parse_assistant_message`.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from jinja2 import TemplateError

__all__ = [
    "FAMILIES",
    "REFERENCE_TOOLS",
    "detect_family",
    "is_prefix_preserving",
    "prepare_chat_template",
    "reference_conversation",
    "supports_tools",
    "training_template",
]

logger = logging.getLogger(__name__)

QWEN3, QWEN2_5, LLAMA3, DEEPSEEK_V3 = "qwen3", "qwen2_5", "llama3", "deepseek_v3"
FAMILIES = (QWEN3, QWEN2_5, LLAMA3, DEEPSEEK_V3)
"""Model families with a bundled training template (`assets/chat_templates/<family>.jinja`)."""

TEMPLATE_DIR = Path(__file__).resolve().parent.parent / "assets" / "chat_templates"
CONTEXT_CHARS = 48  # text shown on each side of a divergence


def _ds(name: str) -> str:
    """A DeepSeek-V3 special token: `_ds("tool calls begin")` -> "<(U+FF5C)tool(U+2581)calls...>"."""
    return "<\uff5c" + name.replace(" ", "\u2581") + "\uff5c>"


DS_ASSISTANT, DS_CALLS_BEGIN, DS_CALLS_END = _ds("Assistant"), _ds("tool calls begin"), _ds("tool calls end")
DS_CALL_BEGIN, DS_CALL_END, DS_SEP = _ds("tool call begin"), _ds("tool call end"), _ds("tool sep")

# -- the reference conversation ---------------------------------------------------------------------

REFERENCE_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluate an arithmetic expression.",
            "parameters": {
                "type": "object",
                "properties": {
                    "expression": {"type": "string", "description": "The expression, e.g. 2 + 3."}
                },
                "required": ["expression"],
            },
        },
    }
]


def _call(expression: str) -> list[dict[str, Any]]:
    return [{"type": "function", "function": {"name": "calculator", "arguments": {"expression": expression}}}]


def reference_conversation(thinking: bool = True) -> list[dict[str, Any]]:
    """A multi-turn tool conversation shaped like the tool loop's (one call per turn: Llama 3.1 allows no
    more). With `thinking`, assistant turns carry reasoning both ways the loop may store it: inline
    `<think>` text in `content`, and `reasoning_content`; without it (`enable_thinking=False`) none do."""

    def think(text: str) -> str:
        return f"<think>\n{text}\n</think>\n\n" if thinking else ""

    reasoning = {"reasoning_content": "The tool says 400; now double it."} if thinking else {}
    return [
        {"role": "system", "content": "You are a careful assistant."},
        {"role": "user", "content": "What is 17 * 23?"},
        {
            "role": "assistant",
            "content": think("I should use the calculator.") + "Let me compute it.",
            "tool_calls": _call("17 * 23"),
        },
        {"role": "tool", "name": "calculator", "content": "391"},
        {
            "role": "assistant",
            "content": "17 * 23 = 391.",
            **({"reasoning_content": "The tool returned 391."} if thinking else {}),
        },
        {"role": "user", "content": "Add 9 to that, then double the result."},
        {"role": "assistant", "content": "", "tool_calls": _call("391 + 9")},
        {"role": "tool", "name": "calculator", "content": "400"},
        {"role": "assistant", "content": "", "tool_calls": _call("400 * 2"), **reasoning},
        {"role": "tool", "name": "calculator", "content": "800"},
        {"role": "assistant", "content": think("Both steps are done.") + "The result is 800."},
        {"role": "user", "content": "Thanks!"},
    ]


# -- the prefix-preserving check ----------------------------------------------------------------------


def _template_text(tokenizer: Any) -> str | None:
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):  # named templates: "tool_use" is the one rendered with tools
        template = template.get("tool_use") or template.get("default")
    return template if isinstance(template, str) else None


def supports_tools(tokenizer: Any) -> bool:
    """Whether the tokenizer's chat template renders tools (it reads the `tools` variable, or is a named
    "tool_use" template); False without a chat template."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict) and "tool_use" in template:
        return True
    text = _template_text(tokenizer)
    return text is not None and re.search(r"\btools\b", text) is not None


def _encode(tokenizer: Any, text: str) -> list[int]:
    """Token ids of a rendered chat, as `apply_chat_template(tokenize=True)` produces them."""
    text_tokenizer = getattr(tokenizer, "tokenizer", tokenizer)  # a processor wraps its tokenizer
    return list(text_tokenizer(text, add_special_tokens=False)["input_ids"])


def _around(text: str, index: int) -> str:
    return repr(text[max(0, index - CONTEXT_CHARS) : index + CONTEXT_CHARS])


def _first_difference(a: Sequence[Any], b: Sequence[Any]) -> int:
    """The first index where `a` and `b` differ (the shorter length when one is a prefix of the other)."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def is_prefix_preserving(
    tokenizer: Any, chat_template_kwargs: dict[str, Any] | None = None
) -> tuple[bool, str]:
    """Check that appending messages never changes how the earlier ones render.

    Renders `reference_conversation()` with the tokenizer's chat template prefix by prefix, from the
    first user message on. A prefix ends after a complete message and gets the generation prompt when
    the next message is the assistant's; each rendering's token ids must be a prefix of the next one's.
    Every assistant turn makes one call (Llama 3.1 allows no more), so no two tool results are adjacent:
    Qwen's templates group adjacent results in one turn, which the tool loop only renders complete.

    Args:
        tokenizer: A tokenizer (or processor) with a `chat_template`.
        chat_template_kwargs: Extra template variables, as the tool loop passes them
            (`enable_thinking=False` removes the reasoning from the reference conversation).

    Returns:
        `(True, "")`, or `(False, explanation)` naming the first message whose rendering changed,
        with the text around the divergence (or the rendering error).
    """
    kwargs = dict(chat_template_kwargs or {})
    if _template_text(tokenizer) is None:
        return False, "the tokenizer has no chat_template"
    messages = reference_conversation(thinking=kwargs.get("enable_thinking") is not False)
    first_user = next(i for i, m in enumerate(messages) if m["role"] == "user")
    history: list[tuple[int, str, list[int]]] = []  # (k, text, ids) of each prefix rendered so far
    for k in range(first_user + 1, len(messages) + 1):
        generation_prompt = k < len(messages) and messages[k]["role"] == "assistant"
        try:
            text = tokenizer.apply_chat_template(
                messages[:k],
                tools=REFERENCE_TOOLS,
                add_generation_prompt=generation_prompt,
                tokenize=False,
                **kwargs,
            )
        except (TemplateError, TypeError, ValueError, KeyError) as exc:
            last = messages[k - 1]
            return False, (
                f"rendering messages[:{k}] (up to message {k - 1}, {last['role']}"
                f"{' with tool_calls' if last.get('tool_calls') else ''}) raised {type(exc).__name__}: {exc}"
            )
        current = (k, text, _encode(tokenizer, text))
        reason = _divergence(tokenizer, messages, history, current) if history else ""
        if reason:
            return False, reason
        history.append(current)
    return True, ""


def _divergence(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    history: list[tuple[int, str, list[int]]],
    current: tuple[int, str, list[int]],
) -> str:
    """Why the last rendering in `history` is not a token prefix of `current`, or "" when it is."""
    (k0, text0, ids0), (k1, text1, ids1) = history[-1], current
    appended = ", ".join(f"message {i} ({messages[i]['role']})" for i in range(k0, k1))
    if not text1.startswith(text0):
        at = _first_difference(text0, text1)
        # The changed text belongs to the first message whose prefix rendering reached past it (or to the
        # generation prompt rendered after that message).
        owner = next((k - 1 for k, text, _ in history if len(text) > at), k0 - 1)
        return (
            f"appending {appended} changes the rendering of earlier messages: the text of messages[:{k0}] is "
            f"not a prefix of the text of messages[:{k1}]; they differ at character {at}, in message {owner} "
            f"({messages[owner]['role']}) or the generation prompt after it.\n"
            f"  messages[:{k0}]: ...{_around(text0, at)}...\n  messages[:{k1}]: ...{_around(text1, at)}..."
        )
    if ids1[: len(ids0)] != ids0:
        at = _first_difference(ids0, ids1)
        return (
            f"appending {appended} keeps the text but changes the tokens: the text of messages[:{k0}] is a "
            f"prefix of the text of messages[:{k1}], yet their token ids differ from token {at} on (text "
            f"merges into one token across the message boundary).\n"
            f"  messages[:{k0}] ends with {tokenizer.decode(ids0[max(0, at - 4) :])!r}\n"
            f"  messages[:{k1}] continues {tokenizer.decode(ids1[max(0, at - 4) : at + 4])!r}"
        )
    return ""


# -- families and bundled templates ------------------------------------------------------------------


def detect_family(tokenizer: Any) -> str | None:
    """The model family of a tokenizer's chat template, by its markers and special tokens.

    Returns:
        "qwen3" (ChatML with `<tool_call>` and `<think>`), "qwen2_5" (ChatML with `<tool_call>`, and no
        `<think>` or Qwen2.5's default system prompt), "llama3" (header tokens and the `ipython` tool
        role of Llama 3.1+), "deepseek_v3" (DeepSeek's assistant and tool-call tokens), or None.
    """
    template = _template_text(tokenizer)
    if template is None:
        return None
    added = set(getattr(tokenizer, "get_added_vocab", dict)())
    if {DS_ASSISTANT, DS_CALLS_BEGIN} <= added and "tool_calls" in template:
        return DEEPSEEK_V3
    if "<|start_header_id|>" in template and "ipython" in template:
        return LLAMA3
    if "<|im_start|>" in template and "<tool_call>" in template and "<function=" not in template:
        # Qwen2.5's default system prompt tells it apart even when a template renders <think> blocks.
        return QWEN3 if "<think>" in template and "created by Alibaba Cloud" not in template else QWEN2_5
    return None


def training_template(family: str) -> str:
    """The bundled prefix-preserving chat template of a family in `FAMILIES`."""
    if family not in FAMILIES:
        raise ValueError(f"no bundled training template for family {family!r}; known families: {FAMILIES}")
    return (TEMPLATE_DIR / f"{family}.jinja").read_text(encoding="utf-8")


def _first_prompt(tokenizer: Any, kwargs: dict[str, Any]) -> str | None:
    """The reference conversation's first prompt (system, user, generation prompt); None if it fails."""
    messages = reference_conversation(thinking=kwargs.get("enable_thinking") is not False)[:2]
    try:
        return tokenizer.apply_chat_template(
            messages, tools=REFERENCE_TOOLS, add_generation_prompt=True, tokenize=False, **kwargs
        )
    except (TemplateError, TypeError, ValueError, KeyError):
        return None


def _switch(tokenizer: Any, family: str, kwargs: dict[str, Any]) -> str:
    """Put the bundled template of `family` on `tokenizer`; on failure restore it and say why."""
    original, before = tokenizer.chat_template, _first_prompt(tokenizer, kwargs)
    tokenizer.chat_template = training_template(family)
    ok, reason = is_prefix_preserving(tokenizer, kwargs)
    after = _first_prompt(tokenizer, kwargs)
    problem = ""
    if not ok:
        problem = (
            f"The bundled {family} training template fails too, with these chat_template_kwargs: {reason}"
        )
    elif before is not None and after != before:
        at = _first_difference(before, after or "")
        problem = (
            f"It looks like {family}, but the bundled {family} training template renders the first prompt "
            f"differently, so it is a variant the bundled template does not reproduce:\n"
            f"  this template: ...{_around(before, at)}...\n  bundled:       ...{_around(after or '', at)}..."
        )
    if problem:
        tokenizer.chat_template = original
    return problem


def prepare_chat_template(
    tokenizer: Any, *, tools_enabled: bool, chat_template_kwargs: dict[str, Any] | None
) -> str | None:
    """Make sure the tool loop gets a prefix-preserving chat template; switch a known family's if needed.

    Without tools nothing is checked (one turn per rollout). With tools: a prefix-preserving template is
    kept; a known family's template is replaced (on `tokenizer`, in place) by the bundled training
    template, with a warning; any other template raises. The switch is refused (the template is left
    as it was) when the bundled template renders the first prompt differently: the tokenizer's template
    is then a variant of the family that the bundled one does not reproduce.

    Returns:
        The family whose training template was switched in, or None when the template was kept.

    Raises:
        ValueError: The template is not prefix-preserving and no bundled template can stand in for it;
            the message holds the divergence and the fix.
    """
    if not tools_enabled:
        return None
    kwargs = dict(chat_template_kwargs or {})
    ok, reason = is_prefix_preserving(tokenizer, kwargs)
    if ok:
        return None
    family = detect_family(tokenizer)
    name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
    if family is None:
        problem = f"Its family is not one with a bundled training template ({', '.join(FAMILIES)})."
    else:
        problem = _switch(tokenizer, family, kwargs)
    if problem:
        raise ValueError(
            f"the chat template of {name!r} is not prefix-preserving, which the tool loop needs (each turn's "
            f"prompt must extend the previous one): {reason}\n{problem}\nPass a `processing_class` whose "
            "`chat_template` renders earlier turns unchanged when messages are appended (keep earlier "
            "reasoning, never re-render an earlier turn differently once it is no longer the last)."
        )
    logger.warning(
        "tools are enabled and the chat template of %r is not prefix-preserving (%s); switched to the "
        "bundled %s training template %s, which renders the prompt, tools and tool calls the same way "
        "but keeps earlier turns unchanged. Pass a processing_class with your own chat_template to "
        "choose otherwise.",
        name,
        reason,
        family,
        TEMPLATE_DIR / f"{family}.jinja",
    )
    return family
