"""One call of a harness through the recording proxy (pure): what goes to the server, what is recorded,
what the harness gets back.

    harness body --upstream_body--> the server's body: the config's sampling settings, a seed of the run's,
                                    the served model, capped max_tokens, and token ids and log-probs asked for
    server reply --recorded_turns--> one TurnRecord per choice: prompt ids, output ids, sampler log-probs,
                                    the sampler's top-K (score centering)
                 --harness_view----> the reply without what the harness did not ask for

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
