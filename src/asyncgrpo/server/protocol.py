"""Wire format of the embedded server, requests: validation into `SeqParams` (vLLM 0.33 shapes);
response bodies are in `responses.py`.

Pure functions: dicts in, validated `SeqParams` out; errors are `ApiError`
carrying vLLM's ErrorResponse fields. See `vllm-protocol.md` sections 2-3 and the real responses
in `vllm-fixtures/protocol-0.33.0.json` (every key present, null where vLLM sends null).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from asyncgrpo.server.sequence import SeqParams

VERSION = "0.33.0+embedded"
PAUSED_MESSAGE = "Generation is paused. Please retry after it resumes."
NEG_INF_SENTINEL = -9999.0
_INT64 = (-(1 << 63), (1 << 63) - 1)
_UNSUPPORTED_EMPTY = ("stop", "logit_bias", "allowed_token_ids", "bad_words", "logprob_token_ids")
_UNSUPPORTED_ZERO = ("presence_penalty", "frequency_penalty")


_ERROR_TYPES = {400: "BadRequestError", 404: "NotFoundError", 409: "ConflictError",
                503: "ServiceUnavailableError"}


class ApiError(Exception):
    """An error answered as vLLM's ErrorResponse."""

    def __init__(self, status: int, message: str, err_type: str | None = None, param: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.err_type = err_type or _ERROR_TYPES.get(status, "InternalServerError")
        self.param = param

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.err_type, self.status, self.param)


def error_body(message: str, err_type: str, code: int, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": err_type, "param": param, "code": code}}


@dataclass(frozen=True)
class ServerSpec:
    """Facts about the served model that validation needs."""

    served_name: str
    max_model_len: int
    max_num_seqs: int
    max_logprobs: int
    vocab_size: int
    return_sampling_mask: bool
    eos_token_id: int | None
    extra_eos_ids: frozenset[int]
    media_token_ids: frozenset[int] = frozenset()  # image/video placeholders of a vision-language checkpoint


def _bad(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param=param)


def _shown(value: Any) -> str:
    """repr of a request value, cut short (a 5000-digit number must not make a 5000-character error)."""
    big = isinstance(value, int) and abs(value) >= 10**40
    text = f"an integer of {len(str(value))} digits" if big else repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _number(raw: dict, key: str, default: float | None) -> float | None:
    value = raw.get(key)
    if value is None:
        return default
    try:
        number = float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else math.nan
    except OverflowError:  # an integer beyond float range
        number = math.nan
    if not math.isfinite(number):
        raise _bad(f"{key} must be a finite number, got {_shown(value)}", key)
    return number


def _integer(raw: dict, key: str, default: int | None) -> int | None:
    """An int64 (vLLM's fields are C integers: a larger one cannot mean anything)."""
    value = raw.get(key)
    if value is None:
        return default
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or not _INT64[0] <= value <= _INT64[1]:
        raise _bad(f"{key} must be a 64-bit integer, got {_shown(value)}", key)
    return value


def stream_include_usage(body: dict) -> bool:
    """`stream_options.include_usage` of a request body; `stream_options` must be an object or null."""
    options = body.get("stream_options")
    if options is None:
        return False
    if not isinstance(options, dict):
        raise _bad("stream_options must be a JSON object such as {\"include_usage\": true}, got "
                   f"{_shown(options)}", "stream_options")
    return bool(options.get("include_usage", False))


def stop_strings(body: dict) -> tuple[str, ...]:
    """`stop` of an OpenAI request (/v1/completions, /v1/chat/completions): a string or a list of strings
    (empty ones ignored)."""
    stop = body.get("stop")
    if stop is None:
        return ()
    values = [stop] if isinstance(stop, str) else stop
    if not isinstance(values, list) or not all(isinstance(v, str) for v in values):
        raise _bad(f"stop must be a string or a list of strings, got {_shown(stop)}", "stop")
    return tuple(dict.fromkeys(v for v in values if v))


def token_id_list(value: Any, spec: ServerSpec, key: str) -> list[int]:
    """A list of vocabulary ids (non-empty, ints in [0, vocab_size))."""
    if not isinstance(value, list) or not value:
        raise _bad(f"{key} must be a non-empty list of token ids", key)
    for t in value:
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < spec.vocab_size:
            raise _bad(f"{key} holds {t!r}, not a token id in [0, {spec.vocab_size})", key)
    return list(value)


_MEDIA_FIELDS = ("features", "multi_modal_data", "mm_features")
_NO_IMAGES = ("images are not supported yet: the embedded server runs the text model of a vision-language "
              "checkpoint; send text-only prompts")


def check_text_only(body: dict, prompts: list[list[int]], spec: ServerSpec, key: str) -> None:
    """400 for image or video content: a multimodal field of the request, or a prompt holding the
    checkpoint's image/video placeholder tokens (which would need the vision tower's features)."""
    for field_name in _MEDIA_FIELDS:
        if body.get(field_name) is not None:
            raise _bad(f"{field_name}: {_NO_IMAGES}", field_name)
    for prompt in prompts:
        media = sorted(set(prompt) & spec.media_token_ids)
        if media:
            raise _bad(f"{key} holds image/video placeholder token ids {media}; {_NO_IMAGES}", key)


def check_model(model: Any, spec: ServerSpec) -> None:
    """vLLM 0.33's answer to a `model` that is neither the base model nor a loaded adapter (its aliases
    list the base model's names only)."""
    if model is not None and model != spec.served_name:
        raise ApiError(404, f"The model `{model}` does not exist. Valid aliases: {spec.served_name}.",
                       param="model")


def parse_sampling(
    raw: dict,
    spec: ServerSpec,
    prompt_len: int,
    *,
    route: str,
    draw_seed: Callable[[], int],
) -> list[SeqParams]:
    """Validate vLLM SamplingParams fields (unknown keys ignored) -> one SeqParams per child (n).

    route "generate": omitted max_tokens fills the context; a prompt of max_model_len tokens or
    more is refused. route "completions": default max_tokens 16, `max_tokens > max_model_len` is
    refused, otherwise it is clamped to the remaining context. route "chat": as "completions", but an
    omitted max_tokens fills the context. Stop strings are the OpenAI routes' (`stop_strings`): the
    caller removes `stop` from `raw` once it has taken them.
    """
    if not isinstance(raw, dict):
        raise _bad("sampling_params must be a JSON object", "sampling_params")
    n = _integer(raw, "n", 1)
    if n < 1:
        raise _bad(f"n must be at least 1, got {n}.", "n")
    if n > spec.max_num_seqs:
        raise _bad(f"n={n} is larger than the server's max_num_seqs ({spec.max_num_seqs}).", "n")
    temperature = _number(raw, "temperature", 1.0)
    if not 0.0 <= temperature <= 2.0:
        raise _bad(f"temperature must be in [0, 2], got {temperature}.", "temperature")
    top_p = _number(raw, "top_p", 1.0)
    if not 0.0 < top_p <= 1.0:
        raise _bad(f"top_p must be in (0, 1], got {top_p}.", "top_p")
    top_k = _integer(raw, "top_k", 0)
    if top_k < -1:
        raise _bad(f"top_k must be -1 (disable), or at least 1, got {top_k}.", "top_k")
    top_k = max(top_k, 0)
    min_p = _number(raw, "min_p", 0.0)
    if not 0.0 <= min_p <= 1.0:
        raise _bad(f"min_p must be in [0, 1], got {min_p}.", "min_p")
    repetition_penalty = _number(raw, "repetition_penalty", 1.0)
    if repetition_penalty <= 0:
        raise _bad(f"repetition_penalty must be greater than zero, got {repetition_penalty}.",
                   "repetition_penalty")
    for key in _UNSUPPORTED_ZERO:
        if _number(raw, key, 0.0) != 0.0:
            raise _bad(f"{key} is not supported by the embedded server; leave it at 0", key)
    for key in _UNSUPPORTED_EMPTY:
        if raw.get(key):
            raise _bad(f"{key} is not supported by the embedded server (token ids only); leave it empty", key)
    logprobs = _integer(raw, "logprobs", None)
    if logprobs is not None and (logprobs < 0 or logprobs > spec.max_logprobs):
        raise _bad(
            f"Requested sample logprobs of {logprobs}, which is greater than max allowed: {spec.max_logprobs}"
            if logprobs > spec.max_logprobs
            else f"logprobs must be non-negative, got {logprobs}.",
            "logprobs",
        )
    if prompt_len >= spec.max_model_len:
        raise _bad(
            f"This model's maximum context length is {spec.max_model_len} tokens. However, your request has "
            f"{prompt_len} input tokens (at least one output token must fit). Please reduce the length of "
            "the input.",
            "input_tokens",
        )
    room = spec.max_model_len - prompt_len
    max_tokens = _integer(raw, "max_tokens", None)
    if max_tokens is not None and max_tokens < 1:
        raise _bad(f"max_tokens must be at least 1, got {max_tokens}.", "max_tokens")
    if route in ("completions", "chat"):
        max_tokens = (16 if route == "completions" else room) if max_tokens is None else max_tokens
        if max_tokens > spec.max_model_len:
            raise _bad(
                f"'max_tokens' is too large: {max_tokens}. This model's maximum context length is "
                f"{spec.max_model_len} tokens and your request has {prompt_len} input tokens.",
                "max_tokens",
            )
        max_tokens = min(max_tokens, room)
    elif max_tokens is None:
        max_tokens = room
    min_tokens = _integer(raw, "min_tokens", 0)
    if not 0 <= min_tokens <= max_tokens:
        raise _bad(f"min_tokens must be in [0, max_tokens={max_tokens}], got {min_tokens}.", "min_tokens")
    stop_ids = raw.get("stop_token_ids") or []
    if not isinstance(stop_ids, list) or not all(type(t) is int for t in stop_ids):
        raise _bad("stop_token_ids must be a list of integers", "stop_token_ids")
    ignore_eos = bool(raw.get("ignore_eos", False))
    seed = _integer(raw, "seed", None)
    want_mask = spec.return_sampling_mask and route == "generate"
    if spec.return_sampling_mask and (temperature <= 0 or top_k <= 0):
        message = (
            "the server returns sampling masks (--return-sampling-mask), which needs temperature > 0 and "
            f"top_k > 0 (got temperature={temperature}, top_k={top_k}); set both or restart the server "
            "without --return-sampling-mask"
        )
        if route == "generate":
            raise _bad(message, "top_k")
        raise ApiError(500, message)  # vLLM 0.33 answers completions with a 500 here
    base = seed if seed is not None else draw_seed()
    return [
        SeqParams(
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            min_p=min_p,
            seed=_wrap64(base + i),
            max_tokens=max_tokens,
            min_tokens=min_tokens,
            stop_token_ids=frozenset(stop_ids),
            eos_token_id=None if ignore_eos else spec.eos_token_id,
            extra_eos_ids=frozenset() if ignore_eos else spec.extra_eos_ids,
            logprobs=logprobs,
            want_mask=want_mask,
            repetition_penalty=repetition_penalty,
        )
        for i in range(n)
    ]


def _wrap64(x: int) -> int:
    return (x + (1 << 63)) % (1 << 64) - (1 << 63)
