"""Compiled decoder layers under inductor match eager (tests/train/test_compiled_layers.py's check). Its own
module because inductor's C++ compile runs child processes: the `process` tier."""

from __future__ import annotations

import pytest
from test_compiled_layers import _check_against_eager

pytestmark = [pytest.mark.process, pytest.mark.slow]


def test_inductor_compiled_layers_match_eager():
    _check_against_eager("inductor", num_rows=2)
