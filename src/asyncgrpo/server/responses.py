"""Wire format of the embedded server, responses: generate / completion / chat completion bodies, their
stream chunks and their log-probs (vLLM 0.33 shapes; requests are validated in `protocol.py`).

Pure functions of a finished or streaming `Sequence`; every key vLLM sends is present (null where
vLLM sends null), see `vllm-fixtures/protocol-0.33.0.json`. Log-probs of -inf are sent as vLLM's
sentinel (-9999.0). Stream chunks of the chat route carry only the keys vLLM sets (it serialises them
with `exclude_unset`); those of /v1/completions carry every key.
"""

from __future__ import annotations

import itertools
import json
import math
import os
from collections.abc import Callable
from typing import Any

from asyncgrpo.server.protocol import NEG_INF_SENTINEL, VERSION
from asyncgrpo.server.sequence import Sequence


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
    lps = clamped_logprobs(seq.logprobs[start:end])
    sampled = list(map(_ENTRY.__mod__, zip(tokens, lps, seq.ranks[start:end], strict=True)))
    top_ids = seq.top_ids[start * k : end * k]
    top_ranks = itertools.cycle(range(1, k + 1))
    top_lps = clamped_logprobs(seq.top_logprobs[start * k : end * k])
    top = list(map(_ENTRY.__mod__, zip(top_ids, top_lps, top_ranks, strict=False)))  # the ranks cycle
    parts = []
    for j, (tok, entry) in enumerate(zip(tokens, sampled, strict=True)):
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
    seq: Sequence, decode: Callable[[int], str], as_ids: bool, start: int = 0, end: int | None = None,
    offset: int = 0,
) -> dict[str, Any]:
    """OpenAI completions log-probs of output tokens [start, end): tokens as text (or "token_id:N"), sampled
    entry first; `offset`: the text offset of token `start` (the characters of the tokens before it)."""

    def name(t: int) -> str:
        return f"token_id:{t}" if as_ids else decode(t)

    end = len(seq.output) if end is None else end
    tokens, offsets, top = [], [], []
    for i in range(start, end):
        tok = seq.output[i]
        text = name(tok)
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
        entry = {text: clamp_logprob(seq.logprobs[i])}
        ids, lps = seq.top(i)
        for tid, tlp in zip(ids, lps, strict=True):
            entry.setdefault(name(tid), clamp_logprob(tlp))
        top.append(entry)
    return {
        "text_offset": offsets,
        "token_logprobs": clamped_logprobs(seq.logprobs[start:end]),
        "tokens": tokens,
        "top_logprobs": top,
    }


def completion_choice(
    index: int, text: str, logprobs: dict | None, finish: tuple[str | None, int | str | None],
    token_ids: list[int] | None, prompt: list[int] | None, versions: list[dict] | None,
) -> dict[str, Any]:
    """One choice of a /v1/completions body; `finish`: (finish_reason, stop_reason)."""
    return {
        "index": index,
        "text": text,
        "logprobs": logprobs,
        "finish_reason": finish[0],
        "stop_reason": finish[1],
        "token_ids": token_ids,
        "prompt_logprobs": None,
        "prompt_token_ids": prompt,
        "routed_experts": None,
        "weight_versions": versions,
    }


def completion_response(
    request_id: str, model: str, created: int, choices: list[dict], num_prompt_tokens: int,
    num_completion_tokens: int,
) -> dict[str, Any]:
    return {
        "id": request_id,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": choices,
        "service_tier": None,
        "system_fingerprint": f"vllm-{VERSION}",
        "usage": usage(num_prompt_tokens, num_completion_tokens),
        "kv_transfer_params": None,
        "ec_transfer_params": None,
        "metrics": None,
    }


def completion_chunk(request_id: str, model: str, created: int, choices: list[dict],
                     usage_: dict | None = None) -> dict[str, Any]:
    """A /v1/completions stream chunk: one choice's new text (`choices` as `stream_choice` gives them), or
    the usage chunk (`choices` empty) that `stream_options.include_usage` asks for."""
    return {"id": request_id, "object": "text_completion", "created": created, "model": model,
            "choices": choices, "usage": usage_}


def stream_choice(
    index: int, text: str, logprobs: dict | None, finish: tuple[str | None, int | str | None] | None,
    token_ids: list[int] | None, prompt: list[int] | None,
) -> dict[str, Any]:
    """A choice of a /v1/completions stream chunk (vLLM's CompletionResponseStreamChoice)."""
    return {"index": index, "text": text, "logprobs": logprobs,
            "finish_reason": finish[0] if finish else None, "stop_reason": finish[1] if finish else None,
            "prompt_token_ids": prompt, "token_ids": token_ids}


# ---- /v1/chat/completions ---------------------------------------------------------------------------


def chat_logprobs(seq: Sequence, start: int, end: int, decode: Callable[[int], str], as_ids: bool,
                  k: int) -> list[dict[str, Any]]:
    """`logprobs.content` of output tokens [start, end): per token its text, log-prob and UTF-8 bytes, and
    `top_logprobs`: the first k of (sampled token, then the top-k by rank), as vLLM lists them."""

    def entry(t: int, logprob: float) -> dict[str, Any]:
        token = f"token_id:{t}" if as_ids else decode(t)
        return {"token": token, "logprob": clamp_logprob(logprob),
                "bytes": list(token.encode("utf-8", errors="replace"))}

    content = []
    for i in range(start, end):
        tok = seq.output[i]
        first = entry(tok, seq.logprobs[i])
        ids, lps = seq.top(i)
        top = [first] + [entry(t, lp) for t, lp in zip(ids, lps, strict=True) if t != tok]
        content.append({**first, "top_logprobs": top[:k]})
    return content


def chat_message(content: str | None, tool_calls: list[dict] | None, reasoning: str | None) -> dict[str, Any]:
    """The assistant message of a chat choice; `tool_calls` (the OpenAI form) only when the model made any."""
    message = {"role": "assistant", "content": content, "refusal": None, "annotations": None, "audio": None,
               "function_call": None, "reasoning": reasoning}
    if tool_calls:
        message["tool_calls"] = tool_calls
    return message


def chat_choice(
    index: int, message: dict, logprobs: list[dict] | None, finish: tuple[str | None, int | str | None],
    token_ids: list[int] | None, versions: list[dict] | None,
) -> dict[str, Any]:
    return {
        "index": index,
        "message": message,
        "logprobs": None if logprobs is None else {"content": logprobs},
        "finish_reason": finish[0],
        "stop_reason": finish[1],
        "token_ids": token_ids,
        "routed_experts": None,
        "weight_versions": versions,
    }


def chat_response(
    request_id: str, model: str, created: int, choices: list[dict], prompt: list[int],
    num_completion_tokens: int, return_token_ids: bool,
) -> dict[str, Any]:
    return {
        "id": request_id,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": choices,
        "service_tier": None,
        "system_fingerprint": f"vllm-{VERSION}",
        "usage": usage(len(prompt), num_completion_tokens),
        "prompt_logprobs": None,
        "prompt_token_ids": prompt if return_token_ids else None,
        "prompt_text": None,
        "kv_transfer_params": None,
        "ec_transfer_params": None,
        "metrics": None,
    }


def chat_chunk(request_id: str, model: str, created: int, choices: list[dict],
               **extra: Any) -> dict[str, Any]:
    """A chat stream chunk (`chat.completion.chunk`); `extra`: `prompt_token_ids` on a choice's first chunk,
    `usage` on the last (with `choices` empty)."""
    return {"id": request_id, "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": choices, **extra}


def chat_delta(
    index: int, delta: dict, logprobs: list[dict] | None = None,
    finish: tuple[str | None, int | str | None] | None = None, token_ids: list[int] | None = None,
) -> dict[str, Any]:
    """A choice of a chat stream chunk: `delta` is {"role"}, {"content"} or {"tool_calls"} (or empty, for a
    chunk that only carries log-probs, token ids or the finish reason)."""
    choice: dict[str, Any] = {"index": index, "delta": delta,
                              "logprobs": None if logprobs is None else {"content": logprobs},
                              "finish_reason": finish[0] if finish else None}
    if finish:
        choice["stop_reason"] = finish[1]
    if token_ids is not None:
        choice["token_ids"] = token_ids
    return choice
