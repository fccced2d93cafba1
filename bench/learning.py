"""Does RL on the bundled tiny model learn, and how fast: the demo (arithmetic, `asyncgrpo demo`) and the
agent example (`examples/increment_env.py`), each over several seeds, one run after the other, as a
user runs them. Writes the held-out rates before and after, the run's wall time and the command:

    python bench/learning.py --seeds 0 1 2 --out bench/results/learning_cpu.json

Each run goes to a subprocess (its own embedded server and rollout process), so runs cannot leak
state into each other; a failed run is recorded with its exit code and the tail of its output.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from provenance import command_line, package_versions

ROOT = Path(__file__).resolve().parents[1]


def run(cmd: list[str], result_file: Path, timeout_s: float) -> dict:
    """One run as a subprocess; its result JSON, or the failure."""
    started = time.perf_counter()
    print("$", " ".join(cmd), flush=True)
    proc = subprocess.run(cmd, check=False, cwd=ROOT, capture_output=True, text=True, timeout=timeout_s)
    elapsed = time.perf_counter() - started
    if proc.returncode != 0 or not result_file.exists():
        return {"status": "failed", "returncode": proc.returncode, "process_s": elapsed,
                "output_tail": (proc.stdout + proc.stderr)[-2000:]}
    result = json.loads(result_file.read_text())
    result["process_s"] = elapsed  # with start-up (imports, model load, server start)
    print(f"  {json.dumps(result)}", flush=True)
    return result


def run_command(name: str, seed: str, out_dir: str, result_file: str, max_steps: int) -> list[str]:
    """The command of one run; the demo writes `accuracy.json` in its output folder, the example the
    file it is given."""
    if name == "demo":
        return [sys.executable, "-m", "asyncgrpo", "demo", "--output-dir", out_dir, "--seed", seed,
                "--max-steps", str(max_steps)]
    return [sys.executable, "examples/increment_env.py", "--seed", seed, "--output-dir", out_dir,
            "--max-steps", str(max_steps), "--result-json", result_file]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--runs", nargs="+", choices=("demo", "increment_env"),
                        default=["demo", "increment_env"])
    parser.add_argument("--max-steps", type=int, default=60)
    parser.add_argument("--timeout-s", type=float, default=900.0, help="Per run.")
    parser.add_argument("--out", default=None, help="Result JSON (printed when not given).")
    args = parser.parse_args()

    report = {
        "machine": f"{os.cpu_count()} CPU cores, {platform.platform()}",
        "packages": package_versions(),
        "model": "asyncgrpo/tiny-chat (bundled)",
        "command": command_line(),
    }
    with tempfile.TemporaryDirectory(prefix="asyncgrpo-learning-") as work:
        for name in args.runs:
            runs = []
            for seed in args.seeds:
                result_file = (Path(work) / f"{name}-{seed}"
                               / ("accuracy.json" if name == "demo" else "result.json"))
                cmd = run_command(name, str(seed), str(result_file.parent), str(result_file), args.max_steps)
                runs.append({"seed": seed, **run(cmd, result_file, args.timeout_s)})
            template = run_command(name, "N", "DIR", "DIR/result.json", args.max_steps)  # (as run, seed N)
            report[name] = {"command": " ".join(["python", *template[1:]]), "runs": runs}
            if args.out:  # after each family, so an interrupted run keeps what finished
                Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    if not args.out:
        print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
