"""Weight-sync benchmark: the trainer's weights pushed into the embedded server, several times, through
the trainer's own path (`CollectiveTransport.push(model, version)`: pause(keep) -> `WeightSender.push` of
`weights_for_server` -> resume); NCCL when the trainer is on CUDA, gloo on CPU, packed layout.

Before each sync every weight is perturbed (seeded), so every push carries new values. Per sync it
reports pause / transfer / resume seconds, bytes and GB/s (bytes / transfer seconds). After the last
sync it checks the server's weights against the trainer's: sha256 of every tensor (the embedded
server's GET /weight_checksum).

    python bench/weight_sync.py          # CPU: random tiny Qwen3, server and trainer on CPU (~30 s)
    python bench/weight_sync.py --servers 3    # the same push into three servers (EveryServer)
    # 2 GPUs: server on GPU 0, trainer on GPU 1, a random Qwen3-0.6B shape (bf16)
    NCCL_NVLS_ENABLE=0 python bench/weight_sync.py --random-qwen3 0.6b \
        --server-device cuda:0 --trainer-device cuda:1 --syncs 10

With `--servers K` the trainer's own several-server path runs (`ServerLinks` + `EveryServer`): every
server paused at once, the weights pushed into each in turn, every server resumed; each server's
weights are checked. `--server-device cuda:N` starts the server with CUDA_VISIBLE_DEVICES=N;
`--trainer-device cuda:M` is a device of this process. `--model-dir` keeps the random model (see
bench/serve_throughput.py). Writes bench/results/weight_sync_<trainer device type>[_<K>servers].json.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast stays off on shared GPUs

import torch
from random_qwen3 import SHAPES, build_random_qwen3


def server_placement(device: str) -> tuple[str, dict[str, str]]:
    """`cpu` -> ("cpu", {}); `cuda:N` -> ("cuda", CUDA_VISIBLE_DEVICES=N): the server sees one GPU."""
    if device == "cpu":
        return "cpu", {"CUDA_VISIBLE_DEVICES": ""}
    kind, _, index = device.partition(":")
    if kind != "cuda":
        raise ValueError(f"--server-device {device!r}: use cpu or cuda:N")
    return "cuda", {"CUDA_VISIBLE_DEVICES": index or "0"}


def perturb(model: torch.nn.Module, seed: int) -> None:
    g = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(
                torch.randn(p.shape, generator=g, device=p.device, dtype=torch.float32).to(p.dtype),
                alpha=1e-3,
            )


def one_sync(transport, model: torch.nn.Module, version: int) -> dict:
    """What `AsyncGRPOTrainer` does at a sync of an unsharded model (`self.weights.push`)."""
    from asyncgrpo.types import WeightVersion

    if model.device.type == "cuda":
        torch.cuda.synchronize(model.device)
    timings = transport.push(model, WeightVersion(version))
    timings["gb_per_s"] = timings["bytes"] / timings["transfer_s"] / 1e9
    return timings


def compare_checksums(urls: list[str], model: torch.nn.Module, dtype: torch.dtype) -> dict:
    from asyncgrpo.generation.client import GenerationClient
    from asyncgrpo.sync.checksum import checksum_mismatches, weights_checksum
    from asyncgrpo.train.weights.gather import weights_for_server

    async def served(url: str) -> tuple[dict[str, str], str]:
        async with GenerationClient(url, timeout_s=600) as client:
            return await client.weight_checksum(), await client.weight_info()

    t0 = time.perf_counter()
    trainer_digests = weights_checksum(weights_for_server(model, dtype))
    mismatches, versions = [], []
    for url in urls:
        server_digests, version = asyncio.run(served(url))
        mismatches += [f"{url}: {name}" for name in checksum_mismatches(trainer_digests, server_digests)]
        versions.append(version)
    return {"ok": not mismatches, "num_tensors": len(trainer_digests), "mismatches": mismatches,
            "server_version": versions[0] if len(set(versions)) == 1 else versions,
            "seconds": time.perf_counter() - t0}


def print_table(syncs: list[dict], checksum: dict) -> None:
    print(f"{'sync':>4} {'pause s':>9} {'transfer s':>11} {'resume s':>9} {'total s':>9} {'MB':>9} "
          f"{'chunks':>7} {'GB/s':>7}")
    for i, s in enumerate(syncs):
        print(f"{i:>4} {s['pause_s']:>9.4f} {s['transfer_s']:>11.4f} {s['resume_s']:>9.4f} "
              f"{s['total_s']:>9.4f} {s['bytes'] / 1e6:>9.2f} {s['num_chunks']:>7.0f} {s['gb_per_s']:>7.3f}")
    state = "equal" if checksum["ok"] else f"DIFFER on {len(checksum['mismatches'])} tensors"
    print(f"checksum after the last sync ({checksum['server_version']}): server and trainer weights {state} "
          f"({checksum['num_tensors']} tensors)")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--random-qwen3", choices=sorted(SHAPES), default="tiny", help="Random Qwen3 shape.")
    p.add_argument(
        "--model-dir", default=None, help="Where to write/reuse the random model (default: a temp dir)."
    )
    p.add_argument(
        "--server-device", default="cpu", help="cpu or cuda:N (the server gets CUDA_VISIBLE_DEVICES=N)."
    )
    p.add_argument("--trainer-device", default="cpu", help="cpu or cuda:M (this process).")
    p.add_argument("--servers", type=int, default=1, help="Embedded servers pushed into at each sync.")
    p.add_argument("--syncs", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1, help="Syncs run first and not reported.")
    p.add_argument("--output", default=None)
    args = p.parse_args(argv)

    from transformers import AutoModelForCausalLM

    from asyncgrpo.launch import EmbeddedServer
    from asyncgrpo.train.server_link import ServerLinks
    from asyncgrpo.train.weights.collective import CollectiveTransport
    from asyncgrpo.train.weights.every_server import EveryServer

    if args.servers < 1:
        p.error(f"--servers {args.servers}: at least 1")
    tmp = tempfile.TemporaryDirectory() if args.model_dir is None else None
    path = Path(args.model_dir or tmp.name)
    if not (path / "config.json").exists():
        print(f"building a random Qwen3-{args.random_qwen3} in {path}", flush=True)
        build_random_qwen3(args.random_qwen3, path)
    kind, server_env = server_placement(args.server_device)
    trainer_device = torch.device(args.trainer_device)
    serve_args = ["--max-model-len", "256", "--max-num-seqs", "8", "--kv-cache-tokens", "4096"]
    print(f"{args.servers} embedded server(s) on {args.server_device}; trainer on {trainer_device}",
          flush=True)
    with contextlib.ExitStack() as stack:
        servers = []
        for i in range(args.servers):
            log = Path(tempfile.gettempdir()) / f"weight_sync_server{i}.log"
            servers.append(stack.enter_context(EmbeddedServer(
                str(path), device=kind, extra_args=serve_args, log_path=log, env=server_env,
                startup_timeout_s=600)))
        urls = [server.url for server in servers]
        links = ServerLinks.open(urls, timeout_s=600)
        transport = None
        try:
            info = links.connect()[0]
            dtype = getattr(torch, str(info.dtype).removeprefix("torch."))
            model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(trainer_device)
            each = [CollectiveTransport(link, trainer_device, dtype) for link in links]
            transport = each[0] if len(each) == 1 else EveryServer(each, links, failover=False)
            t0 = time.perf_counter()
            transport.init()
            init_s = time.perf_counter() - t0
            syncs = []
            for i in range(args.warmup + args.syncs):
                perturb(model, seed=i)
                timings = one_sync(transport, model, version=i + 1)
                if i >= args.warmup:
                    syncs.append(timings)
            checksum = compare_checksums(urls, model, dtype)
        finally:
            if transport is not None:
                transport.close()
            for link in links:
                link.close()
    if tmp is not None:
        tmp.cleanup()

    print_table(syncs, checksum)
    summary = {key: statistics.median(s[key] for s in syncs)
               for key in ("pause_s", "transfer_s", "resume_s", "total_s", "gb_per_s")}
    summary["bytes"] = syncs[0]["bytes"]
    print(f"median: transfer {summary['transfer_s']:.4f} s, total {summary['total_s']:.4f} s, "
          f"{summary['gb_per_s']:.3f} GB/s; group init {init_s:.2f} s")
    names = {d: torch.cuda.get_device_name(torch.device(d)) if d.startswith("cuda") else platform.machine()
             for d in {args.trainer_device}}
    meta = {
        "trainer_device": args.trainer_device,
        "server_device": args.server_device,
        "device_names": names,
        "backend": "nccl" if trainer_device.type == "cuda" else "gloo",
        "servers": args.servers,
        "dtype": str(dtype).removeprefix("torch."),
        "params": sum(p.numel() for p in model.parameters()),
        "torch": torch.__version__,
        "platform": platform.platform(),
        "args": vars(args),
    }
    suffix = "" if args.servers == 1 else f"_{args.servers}servers"
    out = Path(args.output or Path(__file__).parent / "results"
               / f"weight_sync_{trainer_device.type}{suffix}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    result = {"meta": meta, "init_s": init_s, "syncs": syncs, "summary": summary, "checksum": checksum}
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")
    return 0 if checksum["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
