"""Wire format of the embedded server, responses: generate / completion bodies and their log-probs
(vLLM 0.33 shapes; requests are validated in `protocol.py`).

Pure functions of a finished or streaming `Sequence`; every key vLLM sends is present (null where
vLLM sends null), see `vllm-fixtures/protocol-0.33.0.json`. Log-probs of -inf are sent as vLLM's
sentinel (-9999.0).
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
