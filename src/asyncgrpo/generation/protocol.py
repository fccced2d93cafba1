"""Request bodies and response parsers of the inference-server protocol (vLLM 0.33 and the embedded
server), one section per endpoint. See `vllm-protocol.md`.

Everything here is pure: dicts and strings in, frozen dataclasses out; no I/O, no logging. A body
that lacks a field the client relies on raises `ProtocolError` naming the endpoint and the field.

Conventions kept here so that callers never see wire quirks:
- log-probs of -9999.0 (the server's stand-in for -inf/NaN) become `float("-inf")`;
- `TurnOutput.top_logprobs` holds the server's top-K per token keyed by token id; the sampled token
  is listed only when it is itself among the top K (the server sends it first in any case, and its
  log-prob is already in `TurnOutput.logprobs`).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

NEG_INF_SENTINEL = -9999.0
"""vLLM sends -inf and NaN log-probs as this value (protocol 3.3)."""

GENERATE_PATH = "/inference/v1/generate"
# the weight version a server reports (`/weight_info`, `weight_versions` spans) before any trainer pushed
# weights into it: vLLM's and the embedded server's, the weights it loaded at start
INITIAL_WEIGHT_VERSION = "default"
COMPLETIONS_PATH = "/v1/completions"
_TOKEN_ID_PREFIX = "token_id:"


class ProtocolError(ValueError):
    """A server answered with a body that lacks what the protocol promises."""


# --------------------------------------------------------------------------------------------------
# Sampling parameters and turn output
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SamplingParams:
    """What one generation request asks for. Every field is sent explicitly, so a server-side
    generation config can never change the sampling distribution behind the trainer's back.

    `top_k=0` disables top-k; `logprobs` is the number of top log-probs per token (0 = only the
    sampled token's, None = none at all); `max_tokens=None` lets the server fill the context;
    `return_sampling_mask` says the caller needs the per-token candidate sets, which only the
    token-in/token-out route of a server started with `--return-sampling-mask` returns."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    max_tokens: int | None = None
    min_tokens: int = 0
    seed: int | None = None
    logprobs: int | None = 0
    repetition_penalty: float = 1.0
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    return_sampling_mask: bool = False

    def to_vllm(self) -> dict[str, Any]:
        """The `sampling_params` object of vLLM (also the sampling fields of /v1/completions)."""
        out: dict[str, Any] = {
            "temperature": float(self.temperature),
            "top_k": int(self.top_k),
            "top_p": float(self.top_p),
            "min_p": float(self.min_p),
            "repetition_penalty": float(self.repetition_penalty),
        }
        if self.max_tokens is not None:
            out["max_tokens"] = int(self.max_tokens)
        if self.min_tokens:
            out["min_tokens"] = int(self.min_tokens)
        if self.seed is not None:
            out["seed"] = int(self.seed)
        if self.logprobs is not None:
            out["logprobs"] = int(self.logprobs)
        if self.stop_token_ids:
            out["stop_token_ids"] = [int(t) for t in self.stop_token_ids]
        if self.ignore_eos:
            out["ignore_eos"] = True
        return out


@dataclass(frozen=True)
class VersionSpan:
    """Output tokens `[start, end)` were produced under weight version `version`."""

    version: str
    start: int
    end: int


@dataclass(frozen=True)
class TurnOutput:
    """One generated turn.

    `logprobs[i]` is the processed log-prob of `token_ids[i]` (-inf when the server had none);
    `top_logprobs[i]` maps token id -> log-prob for the server's top-K at position i (None when not
    requested or not recoverable); `sampling_mask[i]` is the ascending list of token ids the sampler
    could draw at position i (None when the server does not return masks)."""

    token_ids: list[int]
    logprobs: list[float] | None
    top_logprobs: list[dict[int, float]] | None
    sampling_mask: list[list[int]] | None
    finish_reason: str | None
    stop_reason: int | str | None
    weight_versions: list[VersionSpan] | None
    request_id: str | None = None


def _logprob(value: Any) -> float:
    if value is None:
        return -math.inf
    value = float(value)
    if value <= NEG_INF_SENTINEL or math.isnan(value):
        return -math.inf
    return value


def _token_id_from_string(token: str, where: str) -> int:
    if not token.startswith(_TOKEN_ID_PREFIX):
        raise ProtocolError(f"{where}: token {token!r} is not of the form 'token_id:N'")
    return int(token[len(_TOKEN_ID_PREFIX) :])


def _entry_token_id(entry: dict[str, Any], where: str) -> int:
    """vLLM >= 0.32 sends integer `token_id`; older generate routes send `"token": "token_id:N"`."""
    if entry.get("token_id") is not None:
        return int(entry["token_id"])
    if isinstance(entry.get("token"), str):
        return _token_id_from_string(entry["token"], where)
    raise ProtocolError(f"{where}: log-prob entry has neither 'token_id' nor 'token': {entry!r}")


def _top_k_only(items: list[tuple[int, float]], k: int) -> dict[int, float]:
    """The engine lists the sampled token first, then the top k; it has k+1 entries exactly when
    the sampled token is outside the top k, in which case the first entry is dropped."""
    if len(items) > k:
        items = items[1:]
    return dict(items)


def _parse_version_spans(raw: Any) -> list[VersionSpan] | None:
    if raw is None:
        return None
    return [VersionSpan(str(s["version"]), int(s["start"]), int(s["end"])) for s in raw]


def _first_choice(body: dict[str, Any], path: str) -> dict[str, Any]:
    choices = body.get("choices") if isinstance(body, dict) else None
    if not choices:
        raise ProtocolError(f"{path}: response has no choices: {json.dumps(body)[:300]}")
    return choices[0]


# --------------------------------------------------------------------------------------------------
# POST /inference/v1/generate
# --------------------------------------------------------------------------------------------------


def build_generate_request(
    prompt_ids: list[int],
    params: SamplingParams,
    *,
    dialect: tuple[int, int, int],
    request_id: str | None = None,
    model: str | None = None,
) -> dict[str, Any]:
    """Body of the token-in/token-out route. `output_mode` exists from 0.32 on. `detokenize` is off:
    the route answers with token ids, and vLLM otherwise decodes every generated token in its API
    server process all the same (its default is on; stop strings, which need it, are not used)."""
    sampling = {**params.to_vllm(), "detokenize": False}
    body: dict[str, Any] = {"token_ids": [int(t) for t in prompt_ids], "sampling_params": sampling}
    if dialect >= (0, 32, 0):
        body["output_mode"] = "tokens"
    if request_id is not None:
        body["request_id"] = request_id
    if model is not None:
        body["model"] = model
    return body


def parse_generate_response(body: dict[str, Any], *, num_top_logprobs: int | None) -> TurnOutput:
    """Parse a non-streaming generate response (first choice). `num_top_logprobs` is the request's
    `logprobs` value (None when log-probs were not requested)."""
    choice = _first_choice(body, GENERATE_PATH)
    if choice.get("token_ids") is None:
        raise ProtocolError(f"{GENERATE_PATH}: choice has no 'token_ids'")
    token_ids = [int(t) for t in choice["token_ids"]]
    logprobs: list[float] | None = None
    top: list[dict[int, float]] | None = None
    raw = choice.get("logprobs")
    if num_top_logprobs is not None:
        if raw is None or raw.get("content") is None:
            raise ProtocolError(f"{GENERATE_PATH}: log-probs were requested but the choice has none")
        content = raw["content"]
        if len(content) != len(token_ids):
            raise ProtocolError(
                f"{GENERATE_PATH}: {len(content)} log-prob entries for {len(token_ids)} tokens"
            )
        logprobs = [_logprob(e.get("logprob")) for e in content]
        if num_top_logprobs > 0:
            top = []
            for i, entry in enumerate(content):
                where = f"{GENERATE_PATH} token {i}"
                items = [
                    (_entry_token_id(t, where), _logprob(t.get("logprob")))
                    for t in entry.get("top_logprobs") or []
                ]
                top.append(_top_k_only(items, num_top_logprobs))
    mask = choice.get("sampling_mask")
    return TurnOutput(
        token_ids=token_ids,
        logprobs=logprobs,
        top_logprobs=top,
        sampling_mask=[[int(t) for t in row] for row in mask] if mask is not None else None,
        finish_reason=choice.get("finish_reason"),
        stop_reason=choice.get("stop_reason"),
        weight_versions=_parse_version_spans(choice.get("weight_versions")),
        request_id=body.get("request_id"),
    )


# --------------------------------------------------------------------------------------------------
# POST /v1/completions (fallback when the generate route is off)
# --------------------------------------------------------------------------------------------------


def build_completions_request(
    prompt_ids: list[int],
    params: SamplingParams,
    *,
    model: str,
    max_model_len: int | None,
    request_id: str | None = None,
) -> dict[str, Any]:
    """Body of /v1/completions with a token-id prompt. Its default `max_tokens` is 16, so an unset
    `max_tokens` becomes the remaining context (`max_model_len - len(prompt)`) when known."""
    body: dict[str, Any] = {"model": model, "prompt": [int(t) for t in prompt_ids], **params.to_vllm()}
    if params.max_tokens is None and max_model_len is not None:
        body["max_tokens"] = max(max_model_len - len(prompt_ids), 1)
    body["return_token_ids"] = True
    body["return_tokens_as_token_ids"] = True
    body["return_weight_versions"] = True
    if request_id is not None:
        body["request_id"] = request_id
    return body


def parse_completions_response(body: dict[str, Any], *, num_top_logprobs: int | None) -> TurnOutput:
    """Parse /v1/completions (first choice). Token ids come from `token_ids`, or from
    `"token_id:N"` token strings. Top log-probs are keyed by token strings there; they are mapped
    back only when every key has the `"token_id:N"` form, else `top_logprobs` is None."""
    path = COMPLETIONS_PATH
    choice = _first_choice(body, path)
    raw = choice.get("logprobs")
    if choice.get("token_ids") is not None:
        token_ids = [int(t) for t in choice["token_ids"]]
    elif raw is not None and raw.get("tokens") is not None:
        token_ids = [_token_id_from_string(t, f"{path} tokens") for t in raw["tokens"]]
    else:
        raise ProtocolError(f"{path}: no 'token_ids' in the choice; the server needs vLLM's return_token_ids")
    logprobs: list[float] | None = None
    top: list[dict[int, float]] | None = None
    if num_top_logprobs is not None:
        if raw is None or raw.get("token_logprobs") is None:
            raise ProtocolError(f"{path}: log-probs were requested but the choice has none")
        if len(raw["token_logprobs"]) != len(token_ids):
            raise ProtocolError(f"{path}: {len(raw['token_logprobs'])} log-probs for {len(token_ids)} tokens")
        logprobs = [_logprob(v) for v in raw["token_logprobs"]]
        tops = raw.get("top_logprobs")
        if num_top_logprobs > 0 and tops is not None:
            keys_are_ids = all(k.startswith(_TOKEN_ID_PREFIX) for d in tops if d for k in d)
            if keys_are_ids:
                top = []
                for d in tops:
                    items = [(_token_id_from_string(k, path), _logprob(v)) for k, v in (d or {}).items()]
                    top.append(_top_k_only(items, num_top_logprobs))
    return TurnOutput(
        token_ids=token_ids,
        logprobs=logprobs,
        top_logprobs=top,
        sampling_mask=None,
        finish_reason=choice.get("finish_reason"),
        stop_reason=choice.get("stop_reason"),
        weight_versions=_parse_version_spans(choice.get("weight_versions")),
        request_id=body.get("id"),
    )


# --------------------------------------------------------------------------------------------------
# Server description: /version, /v1/models, /server_info, /get_world_size
# --------------------------------------------------------------------------------------------------


TRAINER_HEADER = "X-Asyncgrpo-Trainer"
"""Request header carrying a trainer's random id, so that the embedded server knows which trainer holds
it (`asyncgrpo.server.lease`). vLLM ignores it."""


# --------------------------------------------------------------------------------------------------
# Errors and simple control replies
# --------------------------------------------------------------------------------------------------


def error_message(text: str) -> str:
    """The human message of an error body: ErrorResponse `{"error": {"message": ...}}`, the pause
    routes' `{"error": "..."}`, FastAPI's `{"detail": ...}`, or the raw text."""
    try:
        body = json.loads(text)
    except (ValueError, TypeError):
        return text.strip()[:2000]
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, dict) and err.get("message") is not None:
            message = str(err["message"])
            return message if message else f"{err.get('type', 'error')} (empty message)"
        if isinstance(err, str):
            return err
        if "detail" in body:
            return str(body["detail"])
        if "message" in body:
            return str(body["message"])
    return text.strip()[:2000]


def expect_field(body: Any, key: str, expected: Any, path: str) -> None:
    """Check a control route's reply, e.g. `{"status": "paused"}`."""
    if not isinstance(body, dict) or body.get(key) != expected:
        raise ProtocolError(f"{path}: expected {{{key!r}: {expected!r}}}, got {body!r}")
