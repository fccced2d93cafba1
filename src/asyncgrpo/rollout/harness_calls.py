"""One call of a harness through the recording proxy (pure): what goes to the server, what is recorded,
what the harness gets back.

    harness body --upstream_body--> the server's body: the config's sampling settings, a seed of the run's,
                                    the served model, capped max_tokens, and token ids and log-probs asked for
                                    (`stream_body` for a streamed call)
    server reply --recorded_turns--> one TurnRecord per choice: prompt ids, output ids, sampler log-probs,
                                    the sampler's top-K (score centering)
                 --harness_view----> the reply without what the harness did not ask for
    streamed chunks --harness_view--> each chunk likewise, as it comes
                    --StreamedReply--> the whole reply, recorded as above

Both OpenAI routes go through here (`/v1/chat/completions`, `/v1/completions`), in vLLM's shapes: token
ids come from vLLM's `return_token_ids`, top log-probs keyed by id from `return_tokens_as_token_ids`.
Sampling is the trainer's, not the harness's: the loss scales the trainer's logits by the config's
`temperature`, so a harness's own temperature (or top_p, penalties, logit_bias) would bias every
importance ratio; those fields are replaced and reported (`overridden`).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from asyncgrpo.rollout.requests import RequestSettings
from asyncgrpo.types import TurnRecord

CHAT_PATH = "/v1/chat/completions"
COMPLETIONS_PATH = "/v1/completions"
ROUTES = (CHAT_PATH, COMPLETIONS_PATH)
TOKEN_ID_PREFIX = "token_id:"  # vLLM's form of a token with return_tokens_as_token_ids

# fields that change the sampling distribution, replaced by the trainer's settings (None: removed)
_NEUTRAL = {"presence_penalty": 0.0, "frequency_penalty": 0.0}
_REMOVED = ("logit_bias", "bad_words", "allowed_token_ids")


@dataclass(frozen=True)
class Asked:
    """What the harness asked for itself, so that the reply it gets has that and no more.

    Attributes:
        logprobs: It asked for log-probs.
        top_logprobs: How many top log-probs per token (chat: `top_logprobs`; completions: `logprobs`).
        token_ids: It asked for `return_token_ids`.
        tokens_as_ids: It asked for `return_tokens_as_token_ids`.
    """

    logprobs: bool
    top_logprobs: int
    token_ids: bool
    tokens_as_ids: bool


class HarnessRequestError(ValueError):
    """A harness request the proxy refuses; the message goes back to the harness as a 400."""


def upstream_body(
    path: str, body: Mapping[str, Any], *, settings: RequestSettings, seed: int, model: str
) -> tuple[dict[str, Any], Asked, dict[str, Any]]:
    """The body to send the server for a harness's `body` on `path`, what the harness asked for, and the
    sampling fields the harness set that were replaced (name -> the harness's value)."""
    if path not in ROUTES:
        raise HarnessRequestError(f"{path} is not proxied; harnesses may call {', '.join(ROUTES)}")
    if not isinstance(body, Mapping):
        raise HarnessRequestError("the request body must be a JSON object")
    out = dict(body)
    chat = path == CHAT_PATH
    if chat:
        asked = Asked(
            logprobs=bool(body.get("logprobs")),
            top_logprobs=int(body.get("top_logprobs") or 0) if body.get("logprobs") else 0,
            token_ids=bool(body.get("return_token_ids")),
            tokens_as_ids=bool(body.get("return_tokens_as_token_ids")),
        )
    else:
        k = body.get("logprobs")
        asked = Asked(
            logprobs=k is not None, top_logprobs=int(k or 0), token_ids=bool(body.get("return_token_ids")),
            tokens_as_ids=bool(body.get("return_tokens_as_token_ids")),
        )
    overridden: dict[str, Any] = {}
    trainer = {"temperature": settings.temperature, "top_p": settings.top_p, "top_k": settings.top_k,
               "min_p": settings.min_p, "repetition_penalty": settings.repetition_penalty, **_NEUTRAL}
    for name, value in trainer.items():
        if name in body and body[name] is not None and _differs(body[name], value, name):
            overridden[name] = body[name]
        out[name] = value
    for name in _REMOVED:
        if body.get(name):
            overridden[name] = body[name]
        out.pop(name, None)
    # one cap for every turn, as the trainer's own rollouts have (max_completion_length)
    asked_max = body.get("max_completion_tokens", body.get("max_tokens"))
    cap = settings.max_tokens if asked_max is None else min(int(asked_max), settings.max_tokens)
    out.pop("max_completion_tokens", None)
    out["max_tokens"] = cap
    out["model"] = model
    out["seed"] = seed
    out.pop("stream", None)  # a stream is asked for by the caller, with the usage chunk (`stream_body`)
    out.pop("stream_options", None)
    out["return_token_ids"] = True
    out["return_tokens_as_token_ids"] = True
    # one more top log-prob than the trainer's top-K: the sampled token is listed first (vLLM)
    top = max(settings.num_logprobs + 1 if settings.num_logprobs else 0, asked.top_logprobs)
    if chat:
        out["logprobs"] = True
        out["top_logprobs"] = top
    else:
        out["logprobs"] = max(top, 1)
    return out, asked, overridden


def stream_body(body: dict[str, Any]) -> dict[str, Any]:
    """`upstream_body`'s result for a streamed call: the server streams it and ends with the usage chunk."""
    return {**body, "stream": True, "stream_options": {"include_usage": True}}


def wants_usage_chunk(body: Mapping[str, Any]) -> bool:
    """Whether a harness's streaming request asked for the usage chunk."""
    return bool((body.get("stream_options") or {}).get("include_usage"))


def _differs(given: Any, value: Any, name: str) -> bool:
    try:
        return float(given) != float(value) and not (name == "min_p" and not given and not value)
    except (TypeError, ValueError):
        return True


def _token_id(token: str) -> int:
    if not token.startswith(TOKEN_ID_PREFIX):
        raise ValueError(f"expected a token as {TOKEN_ID_PREFIX}N (return_tokens_as_token_ids), "
                         f"got {token!r}")
    return int(token[len(TOKEN_ID_PREFIX):])


def _top_k(entries: Mapping[int, float], k: int) -> dict[int, float]:
    """The k most likely of `entries` (the sampled token may be listed first without being among them)."""
    return dict(sorted(entries.items(), key=lambda item: -item[1])[:k])


def recorded_turns(path: str, reply: Mapping[str, Any], *, num_logprobs: int) -> list[TurnRecord]:
    """One `TurnRecord` per choice of a server `reply` to `upstream_body`'s request: the prompt ids, the
    sampled ids and their sampler log-probs, and (`num_logprobs` > 0) the sampler's top `num_logprobs`
    log-probs per token keyed by id. Raises `ValueError` when the reply lacks them."""
    turns = []
    for choice in reply.get("choices") or []:
        prompt_ids = choice.get("prompt_token_ids") or reply.get("prompt_token_ids")
        output_ids = choice.get("token_ids")
        if prompt_ids is None or output_ids is None:
            raise ValueError(
                f"{path}: the server's reply has no token ids (return_token_ids); the recording proxy "
                "needs a server that returns them: the embedded server, or vLLM >= 0.10"
            )
        logprobs, top = _choice_logprobs(path, choice.get("logprobs"), len(output_ids))
        turns.append(TurnRecord(
            prompt_ids=[int(t) for t in prompt_ids],
            output_ids=[int(t) for t in output_ids],
            output_log_probs=logprobs,
            output_sampler_logprobs=[_top_k(t, num_logprobs) for t in top] if num_logprobs else None,
        ))
    return turns


def _choice_logprobs(path: str, logprobs: Any, n: int) -> tuple[list[float], list[dict[int, float]]]:
    """(sampled log-prob per token, top log-probs per token keyed by id) of one choice."""
    if n == 0:
        return [], []
    if not logprobs:
        raise ValueError(f"{path}: the server's reply has no log-probs for a choice of {n} tokens")
    if path == CHAT_PATH:
        content = logprobs.get("content") or []
        values = [float(entry["logprob"]) for entry in content]
        top = [{_token_id(t["token"]): float(t["logprob"]) for t in entry.get("top_logprobs") or []}
               for entry in content]
    else:
        values = [float(v) for v in logprobs.get("token_logprobs") or []]
        top = [{_token_id(tok): float(lp) for tok, lp in (entry or {}).items()}
               for entry in logprobs.get("top_logprobs") or []]
    if len(values) != n or len(top) != n:
        raise ValueError(f"{path}: the server's reply has {len(values)} log-probs for {n} tokens")
    return values, top


def harness_view(
    path: str, reply: Mapping[str, Any], asked: Asked, decode: Callable[[int], str]
) -> dict[str, Any]:
    """`reply` as the harness should see it: log-probs, token ids and id-form tokens only where it asked
    for them (`decode(token_id)` gives a token's text). `reply` itself is not modified."""
    view = copy.deepcopy(dict(reply))
    if not asked.token_ids:
        view.pop("prompt_token_ids", None)
    for choice in view.get("choices") or []:
        if not asked.token_ids:
            choice.pop("token_ids", None)
            choice.pop("prompt_token_ids", None)
        if not asked.logprobs:
            choice["logprobs"] = None
        elif choice.get("logprobs"):
            choice["logprobs"] = _trim_logprobs(path, choice["logprobs"], asked, decode)
    return view


def _trim_logprobs(
    path: str, logprobs: dict[str, Any], asked: Asked, decode: Callable[[int], str]
) -> dict[str, Any]:
    def token(text: str) -> str:
        if asked.tokens_as_ids or not text.startswith(TOKEN_ID_PREFIX):
            return text
        return decode(_token_id(text))

    k = asked.top_logprobs
    if path == CHAT_PATH:
        content = []
        for entry in logprobs.get("content") or []:
            def part(item: dict[str, Any]) -> dict[str, Any]:
                text = token(item["token"])
                return {**item, "token": text, "bytes": list(text.encode("utf-8", errors="replace"))}

            top = [part(t) for t in (entry.get("top_logprobs") or [])[:k]]
            content.append({**part(entry), "top_logprobs": top})
        return {**logprobs, "content": content}
    tokens = [token(t) for t in logprobs.get("tokens") or []]
    top = [None if entry is None else {token(t): lp for t, lp in list(entry.items())[:k]}
           for entry in logprobs.get("top_logprobs") or []]
    return {**logprobs, "tokens": tokens, "top_logprobs": top}


class StreamedReply:
    """The chunks of a streamed reply gathered into the shape of a whole one (what `recorded_turns` and the
    completion for reward functions read): per choice its token ids, log-probs, text, tool calls and finish
    reason; the prompt ids."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._top: dict[str, Any] = {}
        self._choices: dict[int, dict[str, Any]] = {}

    def add(self, chunk: Mapping[str, Any]) -> None:
        for key in ("id", "created", "model", "usage"):
            if chunk.get(key) is not None:
                self._top[key] = chunk[key]
        if chunk.get("prompt_token_ids") is not None:
            self._top["prompt_token_ids"] = chunk["prompt_token_ids"]
        for part in chunk.get("choices") or []:
            choice = self._choices.setdefault(int(part.get("index", 0)), {"token_ids": [], "text": "",
                                                                          "logprobs": [], "tool_calls": {}})
            choice["token_ids"] += part.get("token_ids") or []
            if part.get("prompt_token_ids") is not None:
                choice["prompt_token_ids"] = part["prompt_token_ids"]
            if part.get("finish_reason") is not None:
                choice["finish_reason"] = part["finish_reason"]
            logprobs = part.get("logprobs") or {}
            if self.path == CHAT_PATH:
                choice["logprobs"] += logprobs.get("content") or []
                delta = part.get("delta") or {}
                choice["text"] += delta.get("content") or ""
                for call in delta.get("tool_calls") or []:  # whole, or in pieces by index (vLLM)
                    held = choice["tool_calls"].setdefault(int(call.get("index", 0)), {"function": {}})
                    for key in ("id", "type"):
                        if call.get(key):
                            held[key] = call[key]
                    function = call.get("function") or {}
                    if function.get("name"):
                        held["function"]["name"] = function["name"]
                    held["function"]["arguments"] = held["function"].get("arguments", "") + (
                        function.get("arguments") or "")
            else:
                choice["text"] += part.get("text") or ""
                choice["logprobs"] += list(
                    zip(
                        logprobs.get("tokens") or [],
                        logprobs.get("token_logprobs") or [],
                        logprobs.get("top_logprobs") or [],
                        strict=False,
                    )
                )

    def reply(self) -> dict[str, Any]:
        """The gathered reply, as the server would have answered the call unstreamed."""
        choices = []
        for index, c in sorted(self._choices.items()):
            choice: dict[str, Any] = {"index": index, "token_ids": c["token_ids"],
                                      "finish_reason": c.get("finish_reason")}
            if "prompt_token_ids" in c:
                choice["prompt_token_ids"] = c["prompt_token_ids"]
            if self.path == CHAT_PATH:
                message: dict[str, Any] = {"role": "assistant", "content": c["text"]}
                if c["tool_calls"]:
                    message["tool_calls"] = [{"type": "function", **call}
                                             for _, call in sorted(c["tool_calls"].items())]
                choice["message"] = message
                choice["logprobs"] = {"content": c["logprobs"]}
            else:
                tokens, values, top = (list(x) for x in zip(*c["logprobs"], strict=True)) if c["logprobs"] \
                    else ([], [], [])
                choice["text"] = c["text"]
                choice["logprobs"] = {"tokens": tokens, "token_logprobs": values, "top_logprobs": top}
            choices.append(choice)
        return {**self._top, "choices": choices}
