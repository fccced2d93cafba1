"""bench/gpu_suite.sh: every section its header lists is one the script runs, and a wrong name stops it
before anything runs (it is used on a rented GPU, where a typo would cost minutes)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.process

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "gpu_suite.sh"


def test_the_header_lists_exactly_the_sections_the_script_runs():
    text = SCRIPT.read_text()
    listed = set(re.findall(r"^#   ([a-z_]+) {2,}", text, flags=re.MULTILINE))
    handled = set(re.findall(r"^    ([a-z_]+)\)$", text, flags=re.MULTILINE))
    usage = set(re.search(r"^#   bash bench/gpu_suite.sh (.+)$", text, flags=re.MULTILINE).group(1).split())
    checked = set(re.search(r'^SECTIONS=" (.+) "$', text, flags=re.MULTILINE).group(1).split())
    assert listed == handled == usage == checked


def test_an_unknown_section_stops_the_script_with_its_name(tmp_path):
    done = subprocess.run(["bash", str(SCRIPT), "tests", "packng"],
                          env={"OUT": str(tmp_path), "PATH": "/usr/bin:/bin"},
                          capture_output=True, text=True, timeout=30, check=False)
    assert done.returncode == 2 and "unknown section packng" in done.stdout
    assert not (tmp_path / "tests.log").exists()  # the valid section before it did not start
