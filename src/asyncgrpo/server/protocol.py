"""Wire format of the embedded server: request validation and response bodies (vLLM 0.33 shapes).

Pure functions: dicts in, validated `SeqParams` or response dicts out; errors are `ApiError`
carrying vLLM's ErrorResponse fields. See `vllm-protocol.md` sections 2-3 and the real responses
in `vllm-fixtures/protocol-0.33.0.json` (every key present, null where vLLM sends null).
"""

from __future__ import annotations

import itertools
import json
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from asyncgrpo.server.scheduler import SeqParams, Sequence

VERSION = "0.33.0+embedded"
PAUSED_MESSAGE = "Generation is paused. Please retry after it resumes."
NEG_INF_SENTINEL = -9999.0
_INT64 = (-(1 << 63), (1 << 63) - 1)
_UNSUPPORTED_EMPTY = ("stop", "logit_bias", "allowed_token_ids", "bad_words", "logprob_token_ids")
_UNSUPPORTED_ZERO = ("presence_penalty", "frequency_penalty")


class ApiError(Exception):
    """An error answered as vLLM's ErrorResponse."""

    def __init__(self, status: int, message: str, err_type: str | None = None, param: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.err_type = err_type or {400: "BadRequestError", 404: "NotFoundError", 409: "ConflictError", 503: "ServiceUnavailableError"}.get(
            status, "InternalServerError"
        )
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
    text = repr(value) if not isinstance(value, int) or abs(value) < 10**40 else f"an integer of {len(str(value))} digits"
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
        raise _bad(f"stream_options must be a JSON object such as {{\"include_usage\": true}}, got {_shown(options)}",
                   "stream_options")
    return bool(options.get("include_usage", False))


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
    if model is not None and model != spec.served_name:
        raise ApiError(404, f"The model `{model}` does not exist.", param="model")


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
    refused, otherwise it is clamped to the remaining context.
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
        raise _bad(f"repetition_penalty must be greater than zero, got {repetition_penalty}.", "repetition_penalty")
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
            f"{prompt_len} input tokens (at least one output token must fit). Please reduce the length of the input.",
            "input_tokens",
        )
    room = spec.max_model_len - prompt_len
    max_tokens = _integer(raw, "max_tokens", None)
    if max_tokens is not None and max_tokens < 1:
        raise _bad(f"max_tokens must be at least 1, got {max_tokens}.", "max_tokens")
    if route == "completions":
        max_tokens = 16 if max_tokens is None else max_tokens
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
    if not isinstance(stop_ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in stop_ids):
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


# ---- responses -------------------------------------------------------------------------------------


def clamp_logprob(x: float) -> float:
    return x if math.isfinite(x) else NEG_INF_SENTINEL


def weight_versions(seq: Sequence, end: int | None = None) -> list[dict[str, Any]]:
    out = []
    for version, start, stop in seq.spans:
        if end is not None:
            stop = min(stop, end)
        if stop > start:
            out.append({"version": version, "start": start, "end": stop})
    return out


def clamped_logprobs(values: list[float]) -> list[float]:
    """`clamp_logprob` of every value."""
    return [x if -math.inf < x < math.inf else NEG_INF_SENTINEL for x in values]


_ENTRY = '{"token_id":%d,"logprob":%r,"rank":%d}'


def token_logprobs(seq: Sequence, start: int, end: int) -> str:
    """Generate-route `logprobs.content` of output tokens [start, end) as JSON text: per token the
    sampled entry, then the top-k deduplicated by id. Rendered with string formatting (floats as
    repr, like json), every entry of the range in one pass, because this is the hot path of large
    responses."""
    k = seq.params.logprobs or 0
    tokens = seq.output[start:end]
    sampled = list(map(_ENTRY.__mod__, zip(tokens, clamped_logprobs(seq.logprobs[start:end]), seq.ranks[start:end])))
    top_ids = seq.top_ids[start * k : end * k]
    top_ranks = itertools.cycle(range(1, k + 1))
    top = list(map(_ENTRY.__mod__, zip(top_ids, clamped_logprobs(seq.top_logprobs[start * k : end * k]), top_ranks)))
    parts = []
    for j, (tok, entry) in enumerate(zip(tokens, sampled)):
        row, ids = top[j * k : (j + 1) * k], top_ids[j * k : (j + 1) * k]
        if tok in ids:
            del row[ids.index(tok)]  # listed first already
        parts.append(f'{entry[:-1]},"top_logprobs":[{",".join([entry, *row])}]}}')
    return "[" + ",".join(parts) + "]"


class Rendered:
    """Collects pre-rendered JSON fragments and splices them into json.dumps output."""

    def __init__(self) -> None:
        self._raw: list[str] = []
        self._tag = os.urandom(16).hex()  # placeholders no request field can spell by chance

    def add(self, text: str) -> str:
        self._raw.append(text)
        return f"\x00{self._tag}{len(self._raw) - 1}\x00"

    def dumps(self, obj: Any) -> str:
        text = json.dumps(obj, separators=(",", ":"))
        for i, raw in enumerate(self._raw):
            text = text.replace(f'"\\u0000{self._tag}{i}\\u0000"', raw, 1)
        return text


def generate_choice(seq: Sequence, start: int, end: int, final: bool, rendered: Rendered) -> dict[str, Any]:
    p = seq.params
    logprobs = None
    if p.logprobs is not None:
        logprobs = {"content": rendered.add(token_logprobs(seq, start, end))}
    return {
        "index": seq.index,
        "finish_reason": seq.finish_reason if final else None,
        "stop_reason": seq.stop_reason if final else None,
        "token_ids": seq.output[start:end],
        "routed_experts": None,
        "sampling_mask": seq.masks[start:end] if p.want_mask else None,
        "weight_versions": weight_versions(seq) if final else None,
        "logprobs": logprobs,
    }


def usage(prompt_tokens: int, completion_tokens: int, details: bool = True) -> dict[str, Any]:
    out = {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
    }
    if details:
        out.update(prompt_tokens_details=None, completion_tokens_details=None)
    return out


def generate_response(
    request_id: str, model: str, created: int, prompt: list[int], seqs: list[Sequence], return_token_ids: bool
) -> str:
    """The non-streaming generate body as JSON text."""
    completion = sum(len(s.output) for s in seqs)
    rendered = Rendered()
    return rendered.dumps({
        "request_id": request_id,
        "model": model,
        "created": created,
        "usage": usage(len(prompt), completion),
        "prompt_logprobs": None,
        "prompt_token_id_logprobs": None,
        "prompt_token_ids": prompt if return_token_ids else None,
        "mm_placeholders": None,
        "metrics": None,
        "kv_transfer_params": None,
        "ec_transfer_params": None,
        "output_mode": "tokens",
        "choices": [generate_choice(s, 0, len(s.output), True, rendered) for s in seqs],
    })


def completion_logprobs(
    seq: Sequence, decode: Callable[[int], str], as_ids: bool
) -> dict[str, Any]:
    """OpenAI completions log-probs: tokens as text (or "token_id:N"), sampled entry first."""

    def name(t: int) -> str:
        return f"token_id:{t}" if as_ids else decode(t)

    tokens, offsets, top = [], [], []
    offset = 0
    for i, tok in enumerate(seq.output):
        text = name(tok)
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
        entry = {text: clamp_logprob(seq.logprobs[i])}
        ids, lps = seq.top(i)
        for tid, tlp in zip(ids, lps):
            entry.setdefault(name(tid), clamp_logprob(tlp))
        top.append(entry)
    return {
        "text_offset": offsets,
        "token_logprobs": [clamp_logprob(x) for x in seq.logprobs],
        "tokens": tokens,
        "top_logprobs": top,
    }


def completion_response(
    request_id: str,
    model: str,
    created: int,
    prompts: list[list[int]],
    seqs_per_prompt: list[list[Sequence]],
    texts: list[list[str]],
    logprobs: list[list[dict | None]],
    return_token_ids: bool,
    return_weight_versions: bool,
) -> dict[str, Any]:
    choices = []
    completion = 0
    for prompt, seqs, prompt_texts, prompt_lps in zip(prompts, seqs_per_prompt, texts, logprobs):
        for seq, text, lps in zip(seqs, prompt_texts, prompt_lps):
            completion += len(seq.output)
            choices.append(
                {
                    "index": len(choices),
                    "text": text,
                    "logprobs": lps,
                    "finish_reason": seq.finish_reason,
                    "stop_reason": seq.stop_reason,
                    "token_ids": list(seq.output) if return_token_ids else None,
                    "prompt_logprobs": None,
                    "prompt_token_ids": prompt if return_token_ids else None,
                    "routed_experts": None,
                    "weight_versions": weight_versions(seq) if return_weight_versions else None,
                }
            )
    return {
        "id": request_id,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": choices,
        "service_tier": None,
        "system_fingerprint": f"vllm-{VERSION}",
        "usage": usage(sum(len(p) for p in prompts), completion),
        "kv_transfer_params": None,
        "ec_transfer_params": None,
        "metrics": None,
    }
