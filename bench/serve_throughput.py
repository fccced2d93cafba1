"""Embedded-server throughput: generated tokens/s at several concurrency levels, side by side with
a plain transformers `generate` loop (and optionally a running vLLM) on the same prompts.

Each level sends C requests at once to /inference/v1/generate (aiohttp; fixed random prompts,
temperature 1, top_k 20, ignore_eos, N tokens each, one seed per request) and counts completion
tokens over the wall time of the wave. Every measurement is the second of two same-shape runs (the
first pays one-time costs: graph captures, allocator growth). Two transformers baselines, sampling with
top_k 20 and exactly N new tokens: `model.generate` on the same C prompts as one batch (what a careful
user writes), and the plain loop that calls `model.generate` on one prompt after the other (what serving
requests with transformers does without a batching server; its rate does not depend on C, so it is
measured once on `--loop-prompts` prompts). `--logprobs K` adds a pass that also asks for K top
log-probs (the baselines then return scores and take the top K of their log-softmax).

    python bench/serve_throughput.py                               # CPU, bundled tiny model (~1-2 min)
    python bench/serve_throughput.py --random-qwen3 0.6b --device cuda --logprobs 8 \
        --prompt-len 128 --max-tokens 256 --model-dir /tmp/qwen3-0.6b-random [--vllm-url URL]

Request shapes, as the trainer sends them (every request its own seed):

    distinct     C different prompts (the default)
    groups       `--group-size G`: C / G prompts, each sent G times (GRPO's num_generations); a server
                 with prefix caching computes each prompt once
    multi-turn   `--turns T`: C conversations; turn t+1 sends turn t's prompt + its completion +
                 `--turn-tokens` new tokens (a tool result or user message), as agent rollouts do;
                 tokens/s count every turn's completion (the transformers baselines are skipped)

The warm-up wave of a level uses other prompts than the timed one (and the same shape), so that no
server finds the timed prompts in its prefix cache.

`--profile-dir DIR` profiles the embedded server's first timed wave (its `/start_profile` and
`/stop_profile` routes): a Chrome trace of the engine thread and the device's kernels, and a table of
what took the most time.

`--model-dir` keeps the random model so that vLLM can serve the same weights
(`--build-only` writes it and exits). Writes bench/results/serve_throughput_<device>.json.

    # the issue's rows: 8 samples of 32 2048-token prompts; a 4-turn conversation
    python bench/serve_throughput.py --random-qwen3 8b --device cuda --logprobs 8 --concurrency 256 \
        --prompt-len 2048 --group-size 8 --vllm-url URL
    python bench/serve_throughput.py --random-qwen3 0.6b --device cuda --logprobs 8 --concurrency 64 \
        --prompt-len 512 --turns 4 --turn-tokens 64 --vllm-url URL
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import platform
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import torch
from provenance import command_line, package_versions
from random_qwen3 import SHAPES, build_random_qwen3


def make_prompts(n: int, length: int, vocab: int, seed: int = 0, group_size: int = 1) -> list[list[int]]:
    """n prompts of `length` random tokens: n / group_size distinct ones, each repeated group_size
    times in a row (a GRPO group)."""
    g = torch.Generator().manual_seed(seed)
    distinct = torch.randint(2, vocab, (-(-n // group_size), length), generator=g).tolist()
    return [p for p in distinct for _ in range(group_size)][:n]


async def server_wave(
    url: str, model: str | None, prompts, max_tokens, top_k, logprobs, seed0=0, turns: int = 1,
    turn_tokens=None, probe=None, log_steps: bool = False,
) -> dict:
    """All prompts at once; with turns > 1 each prompt starts a conversation whose next turn extends the
    previous prompt and completion with turn_tokens[i][t] (a list per prompt and turn). `probe(url)`:
    the server's engine counters (`engine_counters`), read around the timed part when given (with every
    step of the timed part one by one when `log_steps`)."""
    import aiohttp

    sampling = {"temperature": 1.0, "top_k": top_k, "max_tokens": max_tokens, "ignore_eos": True}
    if logprobs:
        sampling["logprobs"] = logprobs
    timeout = aiohttp.ClientTimeout(total=3600)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout) as session:

        async def request(prompt, params: dict, seed: int) -> list[int]:
            body = {"token_ids": prompt, "sampling_params": {**params, "seed": seed}}
            if model:
                body["model"] = model
            async with session.post(f"{url}/inference/v1/generate", json=body) as resp:
                data = await resp.json()
                if resp.status != 200:
                    raise RuntimeError(f"{url}: HTTP {resp.status}: {data}")
            return [t for c in data["choices"] for t in c["token_ids"]]

        async def conversation(i: int, prompt, params: dict) -> int:
            tokens = 0
            for t in range(turns):
                out = await request(prompt, params, seed0 + i * turns + t)
                tokens += len(out)
                if t + 1 < turns:
                    prompt = prompt + out + turn_tokens[i][t]
            return tokens

        # warm-up wave of the same shape (connections, graph captures) on the prompts reversed: groups
        # stay groups, and nothing of the timed prompts gets into a prefix cache. Few tokens, except for
        # conversations, whose later turns reach longer contexts (graph buckets) than a first turn
        warm = [p[::-1] for p in prompts]
        if turns > 1:
            await asyncio.gather(*(conversation(i, p, sampling) for i, p in enumerate(warm)))
        else:
            await asyncio.gather(*(request(p, {**sampling, "max_tokens": 4}, i) for i, p in enumerate(warm)))
        before = probe(url) if probe else None
        start = time.perf_counter()
        counts = await asyncio.gather(*(conversation(i, p, sampling) for i, p in enumerate(prompts)))
        elapsed = time.perf_counter() - start
    tokens = sum(counts)
    result = {"tokens": tokens, "seconds": elapsed, "tokens_per_s": tokens / elapsed}
    if before is not None:  # the embedded server: how its engine thread spent the timed part
        from asyncgrpo.server.metrics import RECENT_STEPS

        after = probe(url, steps=RECENT_STEPS)
        steps, busy = after["num_steps"] - before["num_steps"], after["step_seconds"] - before["step_seconds"]
        queries = after["prefix_cache"]["queries"] - before["prefix_cache"]["queries"]
        hits = after["prefix_cache"]["hits"] - before["prefix_cache"]["hits"]
        result["engine"] = {
            "steps": steps, "prefill_steps": after["num_prefill_steps"] - before["num_prefill_steps"],
            "step_seconds": busy, "busy_frac": busy / elapsed, "mean_step_ms": 1e3 * busy / max(steps, 1),
            # where the engine thread's step time went (the model runner's step waits for the device)
            "mean_phase_ms": {k: 1e3 * (v - before["step_phase_seconds"][k]) / max(steps, 1)
                              for k, v in after["step_phase_seconds"].items()},
            # CUDA graphs captured during the wave (shapes the warm-up did not meet), and their cost
            "graph_captures": after.get("graph_captures", 0) - before.get("graph_captures", 0),
            "graph_capture_seconds": (after.get("graph_capture_seconds", 0.0)
                                      - before.get("graph_capture_seconds", 0.0)),
            "prefix_cache_hit_rate": hits / max(queries, 1),
        }
        # the wave's steps one by one (its last RECENT_STEPS ones if it ran more: `steps_logged` says)
        records = after["recent_steps"][-steps:] if steps else []
        result["engine"].update(steps_logged=len(records), step_ms=step_summary(records))
        if log_steps:
            result["engine"]["recent_steps"] = records
    return result


def step_summary(records: list[dict]) -> dict:
    """Quantiles of the steps' phases (ms), decode-only steps apart from those with prompt tokens: which
    steps are slow, and whether launching, waiting for the device or attention reads (kv_tokens) grew."""
    out = {}
    for kind, rows in (("decode", [r for r in records if not r["prefill_tokens"]]),
                       ("prefill", [r for r in records if r["prefill_tokens"]])):
        if not rows:
            continue
        q = {}
        for key in ("forward_ms", "record_ms", "wait_ms", "schedule_ms", "kv_tokens", "decode"):
            v = np.asarray([r[key] for r in rows], dtype=np.float64)
            p50, p90 = np.percentile(v, [50, 90])
            q[key] = {"p50": float(p50), "p90": float(p90), "max": float(v.max()), "sum": float(v.sum())}
        out[kind] = {"steps": len(rows), "captures": sum(r["captured"] for r in rows), **q}
    return out


def hf_loop(model, prompts, max_tokens, top_k, logprobs, device) -> dict:
    """`generate` on one prompt after the other: the rate of serving requests one at a time."""
    hf_generate(model, prompts[0], max_tokens, top_k, logprobs, device)  # warm-up, same shape
    tokens, seconds = 0, 0.0
    for prompt in prompts:
        r = hf_generate(model, prompt, max_tokens, top_k, logprobs, device)
        tokens += r["tokens"]
        seconds += r["seconds"]
    return {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds}


def hf_wave(model, prompts, max_tokens, top_k, logprobs, device) -> dict:
    """`generate` on the prompts as one batch, timed on the second of two calls of the same shape and
    length: the first call of a shape runs slower (recorded as `first_call_tokens_per_s`), and the
    server is timed warm too."""
    first = hf_generate(model, prompts, max_tokens, top_k, logprobs, device)
    return {**hf_generate(model, prompts, max_tokens, top_k, logprobs, device),
            "first_call_tokens_per_s": first["tokens_per_s"]}


def hf_generate(model, prompts, max_tokens, top_k, logprobs, device) -> dict:
    """One timed `generate` call on a batch of prompts (or a single one)."""
    ids = torch.tensor(prompts if isinstance(prompts[0], list) else [prompts], device=device)
    kwargs = {
        "do_sample": True, "temperature": 1.0, "top_k": top_k, "top_p": 1.0, "max_new_tokens": max_tokens,
        "min_new_tokens": max_tokens, "pad_token_id": 0, "attention_mask": torch.ones_like(ids),
    }
    if logprobs:
        kwargs.update(output_scores=True, return_dict_in_generate=True)
    _sync(device)
    start = time.perf_counter()
    out = model.generate(ids, **kwargs)
    if logprobs:  # the server reports top-K processed log-probs: do the same with the scores
        tops = [torch.log_softmax(s.float(), dim=-1).topk(logprobs, dim=-1) for s in out.scores]
        _ = [t.values.cpu() for t in tops]
        out = out.sequences
    _sync(device)
    elapsed = time.perf_counter() - start
    tokens = (out.shape[1] - ids.shape[1]) * out.shape[0]
    return {"tokens": tokens, "seconds": elapsed, "tokens_per_s": tokens / elapsed}


def engine_counters(url: str, steps: int = 0) -> dict | None:
    """The embedded server's engine counters (steps, steps with prefill, seconds inside steps) from
    /server_info, with its last `steps` steps one by one (`recent_steps`), or None for a server without
    them (vLLM)."""
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(f"{url}/server_info?config_format=json&steps={steps}") as r:
            return json.loads(r.read()).get("embedded")
    except urllib.error.HTTPError:  # vLLM serves /server_info only in its dev mode
        return None


def post_json(url: str, path: str) -> dict:
    import urllib.request

    request = urllib.request.Request(url + path, data=b"{}", method="POST",
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=600) as response:
        return json.loads(response.read())


def wait_for_health(url: str, timeout_s: float) -> None:
    """Block until `url`/health answers 200 (a server started alongside this benchmark may still load)."""
    import urllib.error
    import urllib.request

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=5) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        if time.monotonic() > deadline:
            raise SystemExit(f"{url}/health did not answer 200 within {timeout_s:.0f} s; is the server "
                             "running?")
        time.sleep(1)


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def prepare_model(args: argparse.Namespace) -> tuple[str, tempfile.TemporaryDirectory | None]:
    """(model path, temp dir to clean up or None): the random Qwen3 of `--random-qwen3`, built in
    `--model-dir` unless it is there already (a temp dir without one), else `--model` resolved."""
    if not args.random_qwen3:
        from asyncgrpo.modeling.load import resolve_model_path

        return resolve_model_path(args.model), None
    tmp = None
    if args.model_dir is None:
        tmp = tempfile.TemporaryDirectory()
        args.model_dir = tmp.name
    path = Path(args.model_dir)
    if not (path / "config.json").exists():
        print(f"building a random Qwen3-{args.random_qwen3} in {path}", flush=True)
        build_random_qwen3(args.random_qwen3, path)
    return str(path), tmp


def write_results(results: dict, name: str, device: str, output: str | None) -> Path:
    """Write the results JSON to `output`, by default bench/results/<name>_<device slug>.json."""
    out = Path(output or Path(__file__).parent / "results" / f"{name}_{device_slug(device)}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    return out


def device_slug(device: str) -> str:
    if device.startswith("cuda") and torch.cuda.is_available():
        return torch.cuda.get_device_name().lower().replace("nvidia ", "").replace(" ", "-")
    return "cpu"


def run_hf(path: str, args, levels, prompts) -> dict:
    from transformers import AutoModelForCausalLM

    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(args.device).eval()
    results = {}
    for k in args.logprob_passes:
        for c in levels:
            r = hf_wave(model, prompts[:c], args.max_tokens, args.top_k, k, args.device)
            results[f"{k}:{c}"] = r
            print(f"  hf generate     logprobs={k:<2} C={c:<4} {r['tokens_per_s']:10.1f} tok/s", flush=True)
        r = hf_loop(model, prompts[: args.loop_prompts], args.max_tokens, args.top_k, k, args.device)
        results[f"{k}:loop"] = r
        print(f"  hf generate     logprobs={k:<2} one prompt at a time {r['tokens_per_s']:10.1f} tok/s",
              flush=True)
    del model
    gc.collect()
    if args.device.startswith("cuda"):
        torch.cuda.empty_cache()
    return results


def run_server(url: str, model: str | None, label: str, args, levels, prompts, warm_prompts, extras) -> dict:
    """Each level timed on its second wave, as `generate` is: the first wave of a level (other prompts of
    the same shape, so that a prefix cache cannot help the timed one) meets the server's one-time costs,
    e.g. capturing the CUDA graphs of new batch sizes; its rate is kept as `first_wave_tokens_per_s`."""
    results = {}
    for k in args.logprob_passes:
        for c in levels:
            shape = {"turns": args.turns, "turn_tokens": extras}
            first = asyncio.run(server_wave(url, model, warm_prompts[:c], args.max_tokens, args.top_k, k,
                                            **shape, probe=engine_counters))
            profile = args.profile_dir and label == "embedded" and not results  # the first timed wave
            if profile:
                post_json(url, "/start_profile")
            r = asyncio.run(server_wave(url, model, prompts[:c], args.max_tokens, args.top_k, k, **shape,
                                        probe=engine_counters, log_steps=args.log_steps))
            if profile:
                r["profile"] = post_json(url, "/stop_profile")
            results[f"{k}:{c}"] = {**r, "first_wave_tokens_per_s": first["tokens_per_s"]}
            if "engine" in first:  # the same wave on other prompts, into a fresh server: compare the steps
                results[f"{k}:{c}"]["first_wave_engine"] = first["engine"]
            line = ""
            if "engine" in r:
                e = r["engine"]
                line = (f"; engine {e['steps']} steps ({e['prefill_steps']} with prefill), busy "
                        f"{e['busy_frac']:.0%}, {e['mean_step_ms']:.2f} ms/step ("
                        + ", ".join(f"{k} {v:.2f}" for k, v in e["mean_phase_ms"].items())
                        + f"; {e['graph_captures']} graphs captured in {e['graph_capture_seconds']:.2f} s)")
            print(f"  {label:<15} logprobs={k:<2} C={c:<4} {r['tokens_per_s']:10.1f} tok/s "
                  f"(first wave {first['tokens_per_s']:.1f}){line}", flush=True)
    return results


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="asyncgrpo/tiny-chat")
    p.add_argument("--random-qwen3", choices=sorted(SHAPES), default=None,
                   help="Benchmark a random Qwen3 shape.")
    p.add_argument("--model-dir", default=None,
                   help="Where to write/reuse the random model (default: a temp dir).")
    p.add_argument("--build-only", action="store_true",
                   help="Write the random model to --model-dir and exit.")
    p.add_argument("--device", default="cpu")
    p.add_argument("--concurrency", default="1,16,64,256", help="Comma-separated concurrency levels.")
    p.add_argument("--prompt-len", type=int, default=None, help="Default: 128 on CUDA, 16 on CPU.")
    p.add_argument("--max-tokens", type=int, default=None, help="Default: 256 on CUDA, 32 on CPU.")
    p.add_argument("--group-size", type=int, default=1, help="Requests per distinct prompt (GRPO group).")
    p.add_argument("--turns", type=int, default=1, help="Turns per conversation (multi-turn shape).")
    p.add_argument("--turn-tokens", type=int, default=32, help="New tokens each later turn adds.")
    p.add_argument("--top-k", type=int, default=20)
    p.add_argument("--logprobs", type=int, default=0, help="Also measure with this many top log-probs.")
    p.add_argument("--vllm-url", default=None, help="Also measure this running vLLM (same model).")
    p.add_argument("--vllm-wait-s", type=float, default=600, help="How long to wait for vLLM's /health.")
    p.add_argument("--skip-hf", action="store_true")
    p.add_argument("--loop-prompts", type=int, default=8, help="Prompts of the one-at-a-time generate loop.")
    p.add_argument("--server-arg", action="append", default=[], help="Extra `asyncgrpo serve` argument.")
    p.add_argument("--profile-dir", default=None,
                   help="Profile the embedded server's first timed wave (its /start_profile, /stop_profile): "
                   "a Chrome trace and a summary table in this directory.")
    p.add_argument("--log-steps", action="store_true",
                   help="Keep every step of the embedded server's timed waves in the JSON (recent_steps).")
    p.add_argument("--output", default=None)
    args = p.parse_args()
    cuda = args.device.startswith("cuda")
    args.prompt_len = args.prompt_len or (128 if cuda else 16)
    args.max_tokens = args.max_tokens or (256 if cuda else 32)
    args.logprob_passes = [0] + ([args.logprobs] if args.logprobs else [])
    levels = [int(x) for x in args.concurrency.split(",")]
    if args.group_size < 1 or args.turns < 1:
        raise SystemExit("--group-size and --turns must be >= 1")
    if args.turns > 1:
        args.skip_hf = True  # generate has no multi-turn equivalent worth timing

    model_path, tmp = prepare_model(args)
    if args.build_only:
        return
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(model_path).vocab_size
    prompts = make_prompts(max(levels), args.prompt_len, vocab, group_size=args.group_size)
    warm_prompts = make_prompts(max(levels), args.prompt_len, vocab, seed=1, group_size=args.group_size)
    extras = [make_prompts(max(args.turns - 1, 1), args.turn_tokens, vocab, seed=2 + i)
              for i in range(max(levels))]
    results: dict = {"config": {k: v for k, v in vars(args).items() if k != "logprob_passes"},
                     "levels": levels}
    results["config"]["model_path"] = model_path
    results["host"] = {"platform": platform.platform(), "torch": torch.__version__,
                       "device_name": device_slug(args.device)}
    results["command"], results["versions"] = command_line(), package_versions()
    if not args.skip_hf:
        print("transformers generate:", flush=True)
        results["hf_generate"] = run_hf(model_path, args, levels, prompts)

    from asyncgrpo.launch import EmbeddedServer

    max_len = args.prompt_len + args.turns * args.max_tokens + (args.turns - 1) * args.turn_tokens + 16
    # every request's own tokens, and each group's prompt once (a cached prompt is shared by its samples;
    # an 8B's 256 x 2048-token prompts would not fit beside vLLM otherwise; without prefix caching,
    # requests wait)
    kv_tokens = (max(levels) * (max_len - args.prompt_len)
                 + -(-max(levels) // args.group_size) * args.prompt_len)
    serve_args = ["--max-model-len", str(max_len), "--max-num-seqs", str(max(levels)),
                  "--kv-cache-tokens", str(kv_tokens), *args.server_arg]
    if args.profile_dir:
        serve_args += ["--profiler-dir", str(Path(args.profile_dir).resolve())]
    log = Path(tempfile.gettempdir()) / "serve_throughput_server.log"
    print(f"embedded server (log: {log}):", flush=True)
    with EmbeddedServer(model_path, device=args.device, extra_args=serve_args, log_path=log,
                        startup_timeout_s=600) as server:
        results["embedded"] = run_server(server.url, None, "embedded", args, levels, prompts, warm_prompts,
                                         extras)
    if args.vllm_url:
        import urllib.request

        wait_for_health(args.vllm_url, args.vllm_wait_s)
        with urllib.request.urlopen(f"{args.vllm_url}/v1/models") as r:
            vllm_model = json.loads(r.read())["data"][0]["id"]
        print(f"vLLM at {args.vllm_url} ({vllm_model}):", flush=True)
        results["vllm"] = run_server(args.vllm_url, vllm_model, "vllm", args, levels, prompts, warm_prompts,
                                     extras)

    print()
    head = (f"{'logprobs':>8} {'C':>5} {'embedded':>10} {'hf batch':>10} {'x batch':>7} {'hf loop':>9} "
            f"{'x loop':>7}")
    if args.vllm_url:
        head += f" {'vllm':>10} {'x vllm':>7}"
    print(head + "   (generated tokens/s)")
    for k in args.logprob_passes:
        for c in levels:
            key = f"{k}:{c}"
            ours = results["embedded"][key]["tokens_per_s"]
            hf = results.get("hf_generate", {}).get(key, {}).get("tokens_per_s")
            loop = results.get("hf_generate", {}).get(f"{k}:loop", {}).get("tokens_per_s")
            nan = float("nan")
            line = f"{k:>8} {c:>5} {ours:>10.1f} {hf or nan:>10.1f} {ours / hf if hf else nan:>7.2f}"
            line += f" {loop or nan:>9.1f} {ours / loop if loop else nan:>7.2f}"
            if args.vllm_url:
                v = results["vllm"][key]["tokens_per_s"]
                line += f" {v:>10.1f} {ours / v:>7.2f}"
            print(line)
    print(f"\nwrote {write_results(results, 'serve_throughput', args.device, args.output)}")
    if tmp is not None:
        tmp.cleanup()


if __name__ == "__main__":
    main()
