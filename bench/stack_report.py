"""Where each sampled process's main thread was busy: the stack samples of bench/stack_sampler.

    ASYNCGRPO_STACK_SAMPLES=/tmp/stacks PYTHONPATH=bench/stack_sampler:$PYTHONPATH python -m some.server ...
    python bench/stack_report.py /tmp/stacks [--min-s 0.5] [--out report.json]

For each process: the longest busy stretches (consecutive samples not waiting in an event loop, a sleep
or a wait, for at least --min-s), each with the functions on its samples' stacks and the share of its
samples each is on (an event loop blocked for seconds shows what blocks it), and the gaps (no sample for
at least --min-s: the main thread held the interpreter lock in one call into C, or the process was not
scheduled), each with its wall time, longest first. Each stretch also gives the CPU seconds its main
thread and its whole process ran (where the sampler recorded them): a main thread with much less CPU than
wall time waited for a core or for the interpreter lock, which another thread of the process held if the
process's CPU time exceeds the main thread's.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from one_gpu_report import write_json
from provenance import command_line

# innermost Python functions of a main thread that waits for work: an idle asyncio loop (selectors), or
# uvloop's, whose loop has no Python frame (the runner's is innermost), a sleep, a wait
IDLE = ("select", "poll", "epoll", "_run_once", "run_forever", "run_until_complete", "run", "sleep", "wait")


def read_samples(path: Path) -> tuple[str, list[tuple[float, list[str]]], list[tuple[float, float] | None]]:
    """(the process's header line, [(wall time, frames innermost first)], [(main-thread CPU s, process
    CPU s) per sample, or None where the line has no CPU times (files of an older sampler)])."""
    header, samples, cpu = "", [], []
    for line in path.read_text().splitlines():
        if line.startswith("#"):
            header = header or line[1:].strip()
            continue
        fields = line.split("\t")
        try:
            stamp = float(fields[0])
            times = (float(fields[1]), float(fields[2])) if len(fields) == 4 else None
        except (ValueError, IndexError):
            continue  # a line cut off when the process was killed
        stack = fields[-1] if len(fields) in (2, 4) else ""
        samples.append((stamp, stack.split(";") if stack else []))
        cpu.append(times)
    return header, samples, cpu


def _idle(frames: list[str]) -> bool:
    return not frames or frames[0].rsplit(":", 1)[-1] in IDLE


def _function(frame: str) -> str:
    """file:function of a `file:line:function` frame (lines vary within a busy stretch)."""
    file, _, rest = frame.partition(":")
    return f"{file}:{rest.partition(':')[2]}"


def busy_stretches_and_gaps(samples: list[tuple[float, list[str]]], min_s: float, top: int = 12,
                            cpu: list[tuple[float, float] | None] | None = None):
    """Stretches of consecutive non-idle samples spanning at least `min_s` seconds, each with the
    functions on its samples' stacks, most frequent first (the share of the stretch's samples each is
    on), and, given the samples' `cpu` times, the CPU seconds its main thread and its process ran; and
    gaps of at least `min_s` between two samples. Longest first."""
    stretches, gaps = [], []
    start = None
    for i, (stamp, frames) in enumerate(samples):
        if i and stamp - samples[i - 1][0] >= min_s:
            gaps.append({"start": samples[i - 1][0], "seconds": round(stamp - samples[i - 1][0], 3),
                         "before": samples[i - 1][1], "after": frames})
        busy = not _idle(frames)
        if busy and start is None:
            start = i
        end_of_stretch = start is not None and (not busy or i == len(samples) - 1)
        if end_of_stretch:
            last = i if busy else i - 1
            seconds = samples[last][0] - samples[start][0]
            if seconds >= min_s:
                counts: dict[str, int] = {}
                for _, stack in samples[start:last + 1]:
                    for name in dict.fromkeys(_function(f) for f in stack):
                        counts[name] = counts.get(name, 0) + 1
                n = last + 1 - start
                functions = sorted(counts.items(), key=lambda kv: -kv[1])[:top]
                stretch = {"start": samples[start][0], "seconds": round(seconds, 3), "samples": n,
                           "functions": [[name, round(c / n, 3)] for name, c in functions]}
                if cpu and cpu[start] is not None and cpu[last] is not None:
                    stretch["main_thread_cpu_s"] = round(cpu[last][0] - cpu[start][0], 3)
                    stretch["process_cpu_s"] = round(cpu[last][1] - cpu[start][1], 3)
                stretches.append(stretch)
            start = None
    return sorted(stretches, key=lambda e: -e["seconds"]), sorted(gaps, key=lambda e: -e["seconds"])


def report(folder: Path, min_s: float) -> list[dict]:
    processes = []
    for path in sorted(folder.glob("stacks-*.tsv")):
        header, samples, cpu = read_samples(path)
        busy, gaps = busy_stretches_and_gaps(samples, min_s, cpu=cpu)
        processes.append({"file": path.name, "process": header, "samples": len(samples), "busy": busy,
                          "gaps": gaps})
    return processes


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("folder")
    p.add_argument("--min-s", type=float, default=0.5)
    p.add_argument("--top", type=int, default=8, help="busy stretches and gaps printed per process")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    processes = report(Path(args.folder), args.min_s)
    if not processes:
        raise SystemExit(f"no stacks-*.tsv in {args.folder}: start the process with ASYNCGRPO_STACK_SAMPLES="
                         f"{args.folder} and bench/stack_sampler first on PYTHONPATH")
    for proc in processes:
        print(f"== {proc['file']} ({proc['samples']} samples): {proc['process']}")
        for stretch in proc["busy"][: args.top]:
            cpu = (f", main thread on a core {stretch['main_thread_cpu_s']:.2f} s, process "
                   f"{stretch['process_cpu_s']:.2f} s"
                   if "main_thread_cpu_s" in stretch else "")
            print(f"  busy {stretch['seconds']:.2f} s from {stretch['start']:.3f} "
                  f"({stretch['samples']} samples{cpu}): "
                  + ", ".join(f"{name} {share:.0%}" for name, share in stretch["functions"]))
        for gap in proc["gaps"][: args.top]:
            print(f"  no sample for {gap['seconds']:.2f} s at {gap['start']:.3f}; after: "
                  + " <- ".join(gap["after"][:8]))
    if args.out:
        write_json(Path(args.out), {"benchmark": "stack_report", "command": command_line(argv),
                                    "min_s": args.min_s, "processes": processes})


if __name__ == "__main__":
    main()
