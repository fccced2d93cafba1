"""`log_completions`: a table of the latest sampled completions (one per group), printed at each log.

The rollout process puts one entry per scored group (`asyncgrpo.rollout.scoring.completion_entry`) on
`channel.extra["completions"]`; the trainer drains it at each `log` and prints the last
`num_completions_to_print` of them (rank 0 only).
"""

from __future__ import annotations

import queue as queue_lib
from typing import Any


def drain(q: Any) -> list[Any]:
    """Everything on the multiprocessing queue `q` now, without waiting."""
    items = []
    while True:
        try:
            items.append(q.get_nowait())
        except (queue_lib.Empty, EOFError, OSError):  # EOFError/OSError: the writer went away
            return items


def print_completions(entries: list[dict[str, Any]], *, step: int, limit: int | None) -> None:
    """A rich table of the last `limit` entries (all when None or 0)."""
    entries = entries[-limit:] if limit else entries
    if not entries:
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"completions at step {step}", show_lines=True)
    for column in ("prompt", "completion", "reward", "advantage", "version"):
        table.add_column(column)
    for e in entries:
        prompt = (e["prompt"] or [{}])[-1].get("content", "")
        completion = "\n".join(str(m.get("content") or m.get("tool_calls") or "") for m in e["completion"])
        table.add_row(prompt, completion, f"{e['reward']:.3f}", f"{e['advantage']:+.3f}",
                      str(e["model_version"]))
    Console().print(table)
