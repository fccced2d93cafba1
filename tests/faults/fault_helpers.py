"""Short-run trainer settings and rewards of the fault tests (imported by them, not collected)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any

from support.short_run import short_run_config  # noqa: F401 -- the fault tests import it from here

MODEL = "asyncgrpo/tiny-chat"
TINY = MODEL


def spread_reward(completions, **kwargs) -> list[float]:
    """0, 1, 2, ... within every group: no group is ever dropped for equal rewards."""
    return [float(i) for i in range(len(completions))]


def call(url: str, method: str, path: str, body: Any = None, headers: dict | None = None,
         timeout: float = 30) -> tuple[int, Any]:
    """One HTTP request -> (status, JSON body, else text). `body` bytes are sent as they are."""
    data = body if isinstance(body, bytes) else (json.dumps(body).encode() if body is not None else None)
    req = urllib.request.Request(url + path, data=data, method=method,
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            status, text, ctype = resp.status, resp.read().decode(), resp.headers.get("Content-Type", "")
    except urllib.error.HTTPError as err:
        status, text, ctype = err.code, err.read().decode(), err.headers.get("Content-Type", "")
    return status, (json.loads(text) if text and "json" in ctype else text)
