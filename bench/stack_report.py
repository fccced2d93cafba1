"""Where each sampled process's main thread stayed: the stack samples of bench/stack_sampler.

    ASYNCGRPO_STACK_SAMPLES=/tmp/stacks PYTHONPATH=bench/stack_sampler:$PYTHONPATH python -m some.server ...
    python bench/stack_report.py /tmp/stacks [--min-s 0.5] [--out report.json]

For each process: the longest stays (consecutive samples with the same innermost frames, event-loop
waits such as selectors' select left out) and gaps (no sample for at least --min-s: the main thread
held the interpreter lock in one call into C, or the process was not scheduled), each with its wall
time and stack, longest first.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from one_gpu_report import write_json

# innermost Python functions of a main thread that waits for work: an idle asyncio loop (selectors), or
# uvloop's, whose loop has no Python frame (the runner's is innermost), a sleep, a wait
IDLE = ("select", "poll", "epoll", "_run_once", "run_forever", "run_until_complete", "run", "sleep", "wait")


def read_samples(path: Path) -> tuple[str, list[tuple[float, list[str]]]]:
    """(the process's header line, [(wall time, frames innermost first)])."""
    header, samples = "", []
    for line in path.read_text().splitlines():
        if line.startswith("#"):
            header = header or line[1:].strip()
            continue
        stamp, _, stack = line.partition("\t")
        try:
            samples.append((float(stamp), stack.split(";") if stack else []))
        except ValueError:
            continue  # a line cut off when the process was killed
    return header, samples


def _idle(frames: list[str]) -> bool:
    return not frames or frames[0].rsplit(":", 1)[-1] in IDLE


def stays_and_gaps(samples: list[tuple[float, list[str]]], min_s: float, depth: int = 6):
    """Runs of samples whose innermost `depth` frames stay the same for at least `min_s` (not idle), and
    gaps of at least `min_s` between samples; each a dict with start, seconds and the stack."""
    stays, gaps = [], []
    run_start = 0
    for i in range(1, len(samples) + 1):
        if i < len(samples):
            (t0, before), (t1, after) = samples[i - 1], samples[i]
            if t1 - t0 >= min_s:
                gaps.append({"start": t0, "seconds": round(t1 - t0, 3), "before": before, "after": after})
            if after[:depth] == samples[run_start][1][:depth]:
                continue
        t_start, frames = samples[run_start]
        seconds = samples[i - 1][0] - t_start
        if seconds >= min_s and not _idle(frames):
            stays.append({"start": t_start, "seconds": round(seconds, 3), "stack": frames})
        run_start = i
    key = lambda entry: -entry["seconds"]
    return sorted(stays, key=key), sorted(gaps, key=key)


def report(folder: Path, min_s: float) -> list[dict]:
    processes = []
    for path in sorted(folder.glob("stacks-*.tsv")):
        header, samples = read_samples(path)
        stays, gaps = stays_and_gaps(samples, min_s)
        processes.append({"file": path.name, "process": header, "samples": len(samples), "stays": stays,
                          "gaps": gaps})
    return processes


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("folder")
    p.add_argument("--min-s", type=float, default=0.5)
    p.add_argument("--top", type=int, default=8, help="stays and gaps printed per process")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    processes = report(Path(args.folder), args.min_s)
    if not processes:
        raise SystemExit(f"no stacks-*.tsv in {args.folder}: start the process with ASYNCGRPO_STACK_SAMPLES="
                         f"{args.folder} and bench/stack_sampler first on PYTHONPATH")
    for proc in processes:
        print(f"== {proc['file']} ({proc['samples']} samples): {proc['process']}")
        for stay in proc["stays"][: args.top]:
            print(f"  stayed {stay['seconds']:.2f} s at {stay['start']:.3f}: " + " <- ".join(stay["stack"][:8]))
        for gap in proc["gaps"][: args.top]:
            print(f"  no sample for {gap['seconds']:.2f} s at {gap['start']:.3f}; after: "
                  + " <- ".join(gap["after"][:8]))
    if args.out:
        write_json(Path(args.out), {"benchmark": "stack_report", "command": " ".join(sys.argv), "min_s": args.min_s,
                                    "processes": processes})


if __name__ == "__main__":
    main()
