"""The embedded server inside a trainer's process (`ServerThread`) shares the interpreter lock with it.

Every torch call of the engine thread lets go of the lock; taking it back waits until the thread that
holds it lets go, which a thread busy in plain Python does only when the interpreter's switch interval
forces it (Python's default: 5 ms). This measures the server's generated tokens/s (64 requests of 64
tokens, the bundled tiny model, sent from another process as the rollout process sends them) with the
trainer's thread idle, busy in plain Python (JSON round trips: what collating, packing and logging
look like to the lock) and busy launching small torch operations (what a forward pass looks like),
at several switch intervals; each run in a fresh process, all in one invocation.

    python bench/in_process_gil.py            # CPU, ~3 min; writes bench/results/in_process_gil_cpu.json

On CPU the engine's eager steps make thousands of torch calls each, so the effect is larger than on a
GPU, where a decode step replays a CUDA graph in a few dozen calls.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import threading
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

LOADS = ("idle", "python", "torch_ops")
INTERVALS = (None, 0.0005, 0.0002, 0.00005)  # None: the server leaves Python's 5 ms
CLIENT = r"""
import asyncio, sys, time
import aiohttp

async def main(url):
    async with aiohttp.ClientSession() as session:
        async def one(i):
            body = {"token_ids": [5 + i % 50, 7, 9, 11],
                    "sampling_params": {"temperature": 1.0, "max_tokens": 64, "ignore_eos": True, "seed": i}}
            async with session.post(url + "/inference/v1/generate", json=body) as r:
                data = await r.json()
                assert r.status == 200, data
                return sum(len(c["token_ids"]) for c in data["choices"])
        await asyncio.gather(*(one(i) for i in range(8)))  # warm-up
        start = time.perf_counter()
        tokens = sum(await asyncio.gather(*(one(i) for i in range(64))))
        print(tokens / (time.perf_counter() - start))

asyncio.run(main(sys.argv[1]))
"""


def busy(load: str, stop: threading.Event, count: list[int]) -> None:
    import torch

    record = {"k": [float(i) for i in range(5000)]}
    x = torch.zeros(8)
    while not stop.is_set():
        if load == "python":
            json.loads(json.dumps(record))
        else:
            for _ in range(100):
                x = x + 1
        count[0] += 1


def one_run(load: str, interval: float | None) -> dict:
    """In this process: the server thread, the trainer's thread under `load`, the client in another."""
    import torch

    from asyncgrpo.launch import free_port
    from asyncgrpo.server.serve import ServeConfig, ServerThread

    torch.set_num_threads(1)
    config = ServeConfig.of("asyncgrpo/tiny-chat", "--port", str(free_port()), "--max-num-seqs", "64")
    with ServerThread(config, switch_interval_s=interval) as server:
        stop, count = threading.Event(), [0]
        worker = None
        if load != "idle":
            worker = threading.Thread(target=busy, args=(load, stop, count), daemon=True)
            worker.start()
        start = time.perf_counter()
        out = subprocess.run([sys.executable, "-c", CLIENT, server.url], check=False, capture_output=True,
                             text=True, timeout=600)
        seconds = time.perf_counter() - start
        stop.set()
        if worker is not None:
            worker.join()
    if out.returncode != 0:
        raise RuntimeError(f"client failed: {out.stderr[-2000:]}")
    return {"load": load, "switch_interval_s": interval or sys.getswitchinterval(),
            "generated_tokens_per_s": float(out.stdout.split()[-1]),
            "load_iterations_per_s": count[0] / seconds}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--loads", default=",".join(LOADS))
    p.add_argument("--output", default=str(Path(__file__).parent / "results" / "in_process_gil_cpu.json"))
    p.add_argument("--one", nargs=2, metavar=("LOAD", "INTERVAL"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one:
        load, interval = args.one
        print(json.dumps(one_run(load, None if interval == "none" else float(interval))))
        return
    rows = []
    for load in args.loads.split(","):
        for interval in INTERVALS if load != "idle" else (None,):
            out = subprocess.run([sys.executable, __file__, "--one", load, str(interval).lower()],
                                 check=False, capture_output=True, text=True, timeout=900)
            if out.returncode != 0:
                raise SystemExit(f"{load} at {interval}: {out.stderr[-3000:]}")
            row = json.loads(out.stdout.strip().splitlines()[-1])
            rows.append(row)
            print(f"{load:<10} switch interval {row['switch_interval_s'] * 1e3:5.2f} ms: "
                  f"{row['generated_tokens_per_s']:8.0f} generated tok/s, "
                  f"load {row['load_iterations_per_s']:9.0f} it/s", flush=True)
    from provenance import command_line, package_versions

    result = {"benchmark": "in_process_gil", "command": command_line(), "versions": package_versions(),
              "host": {"platform": platform.platform(), "cpus": os.cpu_count()}, "rows": rows}
    Path(args.output).write_text(json.dumps(result, indent=1))
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
