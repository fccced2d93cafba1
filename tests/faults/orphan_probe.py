"""Parent side of tests/faults/test_parent_death.py's quick test: spawns a child that calls
`exit_with_parent`, prints the child's pid (the child then prints "armed"), and waits to be killed.

    python tests/faults/orphan_probe.py prctl|watchdog
"""

from __future__ import annotations

import multiprocessing as mp
import os
import sys
import time

from asyncgrpo import parent_watch as parent_death


def child(parent_pid: int, use_prctl: bool) -> None:
    if not use_prctl:  # the fallback alone, as on a platform without prctl
        parent_death._set_parent_death_signal = lambda sig: False
    parent_death.exit_with_parent(parent_pid, poll_s=0.1)
    print("armed", flush=True)
    time.sleep(600)


if __name__ == "__main__":
    process = mp.get_context("spawn").Process(target=child,
                                              args=(os.getpid(), sys.argv[1] == "prctl"), daemon=False)
    process.start()
    print(process.pid, flush=True)
    time.sleep(600)
