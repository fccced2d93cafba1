"""The environment of a test's helper script run as a child process."""

from __future__ import annotations

import os
from pathlib import Path

TESTS = Path(__file__).resolve().parent.parent


def script_env(script: Path, **extra: str) -> dict[str, str]:
    """os.environ with the script's folder and tests/ first on PYTHONPATH: the script imports its
    folder's helpers, and they import `support` as the tests themselves do."""
    path = [str(Path(script).resolve().parent), str(TESTS), os.environ.get("PYTHONPATH", "")]
    return {**os.environ, **extra, "PYTHONPATH": os.pathsep.join(p for p in path if p)}
