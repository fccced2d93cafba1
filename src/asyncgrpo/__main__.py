"""`python -m asyncgrpo ...`: the `asyncgrpo` command, for environments whose scripts are not on PATH."""

import sys

from asyncgrpo.cli import main

sys.exit(main())
