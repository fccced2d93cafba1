"""What a result file records about how it was made: the command line that reproduces it and the
versions of the packages that decide its numbers."""

from __future__ import annotations

import importlib.metadata
import shlex
import sys
from pathlib import Path

PACKAGES = ("torch", "triton", "transformers", "fla-core", "liger-kernel", "flash-attn-4",
            "nvidia-cutlass-dsl")


def command_line(argv: list[str] | None = None) -> str:
    """`python bench/<script>.py <arguments>`: the script as run (relative to the project root when it
    lies under it), then argv (the process's own arguments where None)."""
    script = Path(sys.argv[0]).resolve()
    root = Path(__file__).resolve().parents[1]
    name = script.relative_to(root).as_posix() if script.is_relative_to(root) else script.as_posix()
    return shlex.join(["python", name, *(sys.argv[1:] if argv is None else argv)])


def package_versions(packages: tuple[str, ...] = PACKAGES) -> dict[str, str | None]:
    """Installed version of each package, None where it is not installed."""
    versions = {}
    for package in packages:
        try:
            versions[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            versions[package] = None
    return versions
