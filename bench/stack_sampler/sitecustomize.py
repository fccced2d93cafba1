"""A sampling profiler for a Python server we do not change (vLLM's API server), without ptrace.

Python imports `sitecustomize` at start-up from the first folder of sys.path that has one, so every
process started with this folder on PYTHONPATH (a server and the processes it spawns) loads this file.
When ASYNCGRPO_STACK_SAMPLES names a folder, a daemon thread writes the main thread's stack every
ASYNCGRPO_STACK_INTERVAL_S seconds (default 0.05) to `<folder>/stacks-<pid>.tsv`: the wall time, the
CPU seconds of the main thread and of the whole process so far, then `file:line:function` frames,
innermost first, joined by ';' (tab-separated). A gap between two samples means the main thread held
the interpreter lock (a long call into C) or the process did not run; a busy stretch whose main thread
got much less CPU time than wall time waited for a core or for the interpreter lock.
`python bench/stack_report.py <folder>` finds where each main thread was busy, and the gaps.
"""

import os

_FOLDER = os.environ.get("ASYNCGRPO_STACK_SAMPLES")

if _FOLDER:
    import sys
    import threading
    import time

    def _frames(frame, depth=32):
        parts = []
        while frame is not None and len(parts) < depth:
            code = frame.f_code
            parts.append(f"{os.path.basename(code.co_filename)}:{frame.f_lineno}:{code.co_name}")
            frame = frame.f_back
        return ";".join(parts)

    def _sample(path, interval_s, main_id):
        main_clock = time.pthread_getcpuclockid(main_id)
        with open(path, "a", buffering=1 << 16) as out:
            out.write(f"# pid {os.getpid()}: {' '.join(sys.argv)[:300]}\n")
            flushed = time.monotonic()
            while True:
                time.sleep(interval_s)
                frame = sys._current_frames().get(main_id)
                if frame is None:  # the main thread ended
                    return
                out.write(f"{time.time():.3f}\t{time.clock_gettime(main_clock):.3f}\t{time.process_time():.3f}"
                          f"\t{_frames(frame)}\n")
                if time.monotonic() - flushed > 1.0:
                    out.flush()
                    flushed = time.monotonic()

    os.makedirs(_FOLDER, exist_ok=True)
    threading.Thread(
        target=_sample,
        args=(os.path.join(_FOLDER, f"stacks-{os.getpid()}.tsv"),
              float(os.environ.get("ASYNCGRPO_STACK_INTERVAL_S", "0.05")), threading.main_thread().ident),
        name="asyncgrpo-stack-sampler", daemon=True,
    ).start()
