"""One GPU, end to end: AsyncGRPOTrainer and its generation server share one GPU; weights move by CUDA IPC.

Trains random-initialised Qwen3 shapes (`bench/random_qwen3.py`: Qwen3-0.6B / -1.7B layer sizes and their
151,936-row vocabulary, a byte-level BPE of as many tokens with Qwen3's special tokens and chat template,
built here) through the public API, as a user would: prompts of ~200 tokens, completions up to 1024
tokens, 8 per group, and a reward that varies from sample to sample (the fraction of even token ids in
the completion: no group is dropped for equal rewards). Per shape one server is started, and
asynchronous (`max_staleness=4`) and strictly on-policy (`max_staleness=0`) runs alternate against it
(async, on-policy; with --repeats 2: async, on-policy, on-policy, async). Each run is measured over
--max-seconds after its first --warmup-steps steps (start-up and compilation are left out, so both
settings get windows of the same length) and stops at the first step end past that.

The trainer runs with its defaults unless told otherwise: compiled decoder layers where its start-up probe
passes, FlashAttention-4 where it runs (`--torch-compile off`, `--flex-attention-backend triton` force the
other paths); each run records what was chosen and the probe's seconds (`fast_paths`).

Per run (`steady_summary` in bench/one_gpu_probes.py says how each number is computed):
  trained tokens/s, generated tokens/s (the server's own counter, read by a thread every 0.5 s and
  interpolated at each step's end, so that the trainer never waits on the server's /metrics; how
  long those reads took is `metrics_read_s`; `round_trip_s`: how long a one-token completion sent every
  0.5 s took to come back, i.e. how far behind the server's HTTP side ran), the perf/* split of a step
  (step, fwd_bwd, optimizer, rollout wait, weight sync and its transfer part), the weight transport
  used, peak GPU memory (trainer: torch.cuda.max_memory_allocated/reserved; every process: nvidia-smi
  per pid, sampled each second; the device), and the rollout process's CPU seconds per generated token
  and busy fraction (near 1: the single-threaded rollout loop would be the bottleneck).
Per shape: medians per setting and the async / on-policy ratios, against the issue's targets (>= 1.3x
trained tokens/s; a weight sync <= 0.1 s).

Progress is printed per step; the JSON (--output; default bench/results/one_gpu_<gpu>[_vllm].json, with
the command) is rewritten after every step, and a run that overstays --max-seconds + --grace-s ends the
process with the JSON saying where it stopped, so a killed or stuck run still leaves its numbers.

    python bench/one_gpu.py --shape 0.6b 1.7b --max-seconds 60     # one H200: embedded server, IPC sync
    python bench/one_gpu.py --shape tiny                           # CPU smoke run, under a minute
    python bench/one_gpu.py --shape 0.6b --sharing mps             # the same with an MPS daemon
                                                                   # (gpu_sharing.py)
    python bench/one_gpu.py --shape 0.6b --sharing in-process      # the server inside the trainer's process
    python bench/one_gpu.py --shape 0.6b --keep-kv-across-syncs     # syncs keep the KV of rollouts in flight

Against a running vLLM 0.33 (its ipc weight-transfer backend) on the same GPU, with the same weights:

    python bench/one_gpu.py --shape 0.6b --model-dir /tmp/qwen3-0.6b-chat --build-only
    VLLM_ALLOW_INSECURE_SERIALIZATION=1 VLLM_SERVER_DEV_MODE=1 vllm serve /tmp/qwen3-0.6b-chat --port 8001 \\
        --weight-transfer-config '{"backend": "ipc"}' --enable-scale-out --logprobs-mode processed_logprobs \\
        --gpu-memory-utilization 0.35 --max-model-len 2048 &
    python bench/one_gpu.py --shape 0.6b --model-dir /tmp/qwen3-0.6b-chat --server vllm \\
        --vllm-url http://127.0.0.1:8001
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import platform
import random
import statistics
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from gpu_sharing import SHARING_MODES, gpu_sharing
from one_gpu_probes import (
    CounterPoller,
    GpuMemory,
    RoundTrip,
    RunRecorder,
    embedded_graph_counts,
    generated_tokens,
    served_model,
    server_cache_config,
    steady_summary,
    wait_until_idle,
)
from one_gpu_report import compare_settings, progress_line, write_json
from provenance import command_line
from random_qwen3 import QWEN3_VOCAB_SIZE, SHAPES, PseudoLanguage, build_random_qwen3, language_for_vocab

# per shape: prompt tokens, completion tokens, group size, packed-row tokens, micro-batches per step,
# the server's max_model_len and the number of prompts (never all used: the runs stop on time)
PRESETS: dict[str, dict[str, int]] = {
    "tiny": {"prompt_tokens": 24, "max_completion": 16, "num_generations": 4, "token_budget": 256,
             "grad_accum": 1, "max_model_len": 128, "num_prompts": 256},
    "0.6b": {"prompt_tokens": 200, "max_completion": 1024, "num_generations": 8, "token_budget": 16384,
             "grad_accum": 4, "max_model_len": 2048, "num_prompts": 4096},
    "1.7b": {"prompt_tokens": 200, "max_completion": 1024, "num_generations": 8, "token_budget": 16384,
             "grad_accum": 4, "max_model_len": 2048, "num_prompts": 4096},
}
VOCAB_SIZES = {"tiny": None, "0.6b": QWEN3_VOCAB_SIZE, "1.7b": QWEN3_VOCAB_SIZE}  # None: the shape's own
SETTINGS = (("async", 4), ("on_policy", 0))  # (name, max_staleness)


def even_token_fraction(completion_ids: list[list[int]], **kwargs: Any) -> list[float]:
    """The reward: the fraction of a completion's token ids that are even. A random model draws ids
    almost uniformly, so it varies between the samples of a group (no group is dropped), and a policy
    can learn it."""
    return [sum(1 for t in ids if t % 2 == 0) / len(ids) if ids else 0.0 for ids in completion_ids]


def make_prompts(tokenizer: Any, language: PseudoLanguage, num_prompts: int, target_tokens: int,
                 seed: int) -> tuple[list[dict], float]:
    """Conversational rows of about `target_tokens` tokens once rendered with the chat template, and
    the measured mean over the first 64 prompts."""
    rng = random.Random(seed)

    def rendered_tokens(text: str) -> int:
        chat = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                             tokenize=False)
        return len(tokenizer(chat, add_special_tokens=False)["input_ids"])

    overhead = rendered_tokens("")
    per_word = sum(rendered_tokens(language.text(rng, 100)) - overhead for _ in range(8)) / 800
    num_words = max(1, round((target_tokens - overhead) / per_word))
    rows = [{"prompt": [{"role": "user", "content": language.text(rng, num_words)}]}
            for _ in range(num_prompts)]
    measured = [rendered_tokens(r["prompt"][0]["content"]) for r in rows[:64]]
    return rows, sum(measured) / len(measured)


def prepare_checkpoint(shape: str, model_dir: Path, device: str) -> None:
    """Build the random checkpoint in `model_dir` unless one is there already."""
    if (model_dir / "config.json").exists() and (model_dir / "tokenizer.json").exists():
        print(f"[{shape}] reusing the checkpoint in {model_dir}", flush=True)
        return
    t0 = time.perf_counter()
    print(f"[{shape}] building a random Qwen3-{shape} with a chat tokenizer in {model_dir}", flush=True)
    build_random_qwen3(shape, model_dir, chat=True, vocab_size=VOCAB_SIZES[shape], device=device)
    print(f"[{shape}] built in {time.perf_counter() - t0:.1f} s", flush=True)


class Bench:
    """The result document and what every run shares (arguments, device, where the JSON goes)."""

    def __init__(self, args: argparse.Namespace, output: Path) -> None:
        import torch
        import transformers

        self.args = args
        self.output = output
        self.device = (args.device if args.device != "auto"
                       else ("cuda" if torch.cuda.is_available() else "cpu"))
        self.started = time.perf_counter()
        self.lock = threading.Lock()
        self.result: dict[str, Any] = {
            "benchmark": "one_gpu",
            "command": command_line(),
            "status": "running",
            "host": platform.node(),
            "device": torch.cuda.get_device_name() if self.device == "cuda" else "cpu",
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "server": args.server,
            "settings": {k: v for k, v in vars(args).items() if k not in ("output",)},
            "shapes": {},
        }

    def save(self) -> None:
        with self.lock:
            self.result["elapsed_s"] = time.perf_counter() - self.started
            write_json(self.output, self.result)

    def abort(self, reason: str) -> None:
        """A run overstayed its time: say so in the JSON and end the process (the server and the rollout
        process watch this process and stop with it)."""
        self.result["status"] = f"aborted: {reason}"
        self.save()
        print(f"ABORTED: {reason}; partial results in {self.output}", flush=True)
        os._exit(3)


def train_once(bench: Bench, shape: str, preset: dict[str, int], setting: tuple[str, int], repeat: int,
               url: str, model_dir: Path, rows: list[dict],
               is_server: Callable[[int], bool]) -> dict[str, Any]:
    """One time-bounded training run; its record is appended to the shape's runs and saved as it goes.
    `is_server(pid)`: whether a process on the GPU belongs to the server (for its memory)."""
    import torch
    from transformers import PrinterCallback

    from asyncgrpo import AsyncGRPOConfig, AsyncGRPOTrainer

    args, cuda = bench.args, bench.device == "cuda"
    name, max_staleness = setting
    run: dict[str, Any] = {"setting": name, "max_staleness": max_staleness, "repeat": repeat,
                           "status": "running"}
    bench.result["shapes"][shape]["runs"].append(run)
    label = f"{shape} {name} #{repeat}"
    run["server_idle_wait_s"] = wait_until_idle(url)  # requests a stopped run left behind
    if cuda:
        torch.cuda.reset_peak_memory_stats()

    def on_record(recorder: RunRecorder) -> None:
        run.update(steps=recorder.steps, transport=recorder.transport, elapsed_s=recorder.elapsed_s())
        print(progress_line(label, recorder.steps[-1]), flush=True)
        bench.save()

    poller = CounterPoller(lambda: generated_tokens(url))
    round_trip = RoundTrip(url, served_model(url))
    run_start = time.perf_counter()
    recorder = RunRecorder(label=label, max_seconds=args.max_seconds, warmup_steps=args.warmup_steps,
                           on_record=on_record, generated=poller)
    limit_s = args.max_seconds + args.grace_s
    watchdog = threading.Timer(limit_s, bench.abort,
                               (f"{label} still running {limit_s:.0f} s after it started",))
    watchdog.daemon = True
    watchdog.start()
    config = AsyncGRPOConfig(
        output_dir=str(Path(args.work_dir) / shape / f"{name}-{repeat}"),
        vllm_server_base_url=url, max_steps=args.max_steps, max_staleness=max_staleness,
        learning_rate=args.learning_rate, num_generations=preset["num_generations"],
        max_completion_length=preset["max_completion"], token_budget=preset["token_budget"],
        gradient_accumulation_steps=preset["grad_accum"],
        gradient_checkpointing=not args.no_gradient_checkpointing,
        bf16=cuda, use_cpu=not cuda, save_strategy="no", report_to="none", disable_tqdm=True, logging_steps=1,
        seed=args.seed, keep_kv_across_syncs=args.keep_kv_across_syncs, torch_compile=args.torch_compile,
        activation_memory_budget=args.activation_memory_budget,
        flex_attention_backend=args.flex_attention_backend,
    )
    print(f"[{label}] starting (max_staleness={max_staleness}; {args.max_seconds:.0f} s after "
          f"{args.warmup_steps} warm-up steps, {limit_s:.0f} s at most)", flush=True)
    memory = GpuMemory()
    with poller, round_trip:  # stopped after the finally below has read the generated tokens
        try:
            with memory:
                trainer = AsyncGRPOTrainer(model=str(model_dir), reward_funcs=even_token_fraction,
                                           train_dataset=rows, args=config, callbacks=[recorder])
                # one progress line per step instead of the log dicts
                trainer.remove_callback(PrinterCallback)
                recorder.trainer = trainer
                paths = trainer.fast_paths  # what the defaults chose on this machine, and the probe's cost
                run["fast_paths"] = {
                    "compiled": paths.compiled, "flash_attention": paths.flex_options is not None,
                    "probe_s": paths.probe_s, "probe_differences": paths.probe_differences,
                    "described": paths.describe(),
                }
                bench.result["shapes"][shape]["num_parameters"] = sum(
                    p.numel() for p in trainer.model.parameters())
                trainer.train()
            run["status"] = "done"
        except BaseException as exc:
            run["status"] = f"failed: {type(exc).__name__}: {exc}"
            raise
        finally:
            watchdog.cancel()
            recorder.fill_generated()
            run["metrics_read_s"] = {"reads": len(poller.read_s), "median": statistics.median(poller.read_s),
                                     "max": max(poller.read_s)} if poller.read_s else None
            run["round_trip_s"] = round_trip.report(since=run_start)
            run["server_graphs"] = embedded_graph_counts(url)  # cumulative over the server's runs
            run.update(steps=recorder.steps, transport=recorder.transport, elapsed_s=recorder.elapsed_s(),
                       stopped_by_time=recorder.stopped_by_time,
                       summary=steady_summary(recorder.steps, args.warmup_steps))
            run["memory"] = {
                "trainer_max_allocated_bytes": torch.cuda.max_memory_allocated() if cuda else None,
                "trainer_max_reserved_bytes": torch.cuda.max_memory_reserved() if cuda else None,
                **memory.report(is_server),
            }
            bench.save()
            trainer = recorder.trainer = None
            gc.collect()
            # freeing device memory synchronizes the device: not during an in-process server's capture
            if cuda:
                from asyncgrpo.capture_gate import device_work

                with device_work():
                    torch.cuda.empty_cache()
    return run


def run_shape(bench: Bench, shape: str) -> None:
    """Checkpoint, prompts, server, then the interleaved runs and their comparison."""
    from asyncgrpo.launch import EmbeddedServer, free_port
    from asyncgrpo.modeling.load import load_tokenizer
    from asyncgrpo.server.serve import ServeConfig, ServerThread

    args = bench.args
    preset = {k: (getattr(args, k) if getattr(args, k) is not None else v) for k, v in PRESETS[shape].items()}
    model_dir = Path(args.model_dir) if args.model_dir else Path(args.work_dir) / f"qwen3-{shape}-chat"
    shape_result: dict[str, Any] = {"model_dir": str(model_dir), "preset": preset, "runs": []}
    bench.result["shapes"][shape] = shape_result
    prepare_checkpoint(shape, model_dir, bench.device)
    tokenizer = load_tokenizer(str(model_dir))
    language = language_for_vocab(VOCAB_SIZES[shape] or SHAPES[shape]["vocab_size"])  # the tokenizer's corpus
    rows, mean_prompt = make_prompts(tokenizer, language, preset["num_prompts"], preset["prompt_tokens"],
                                     args.seed)
    shape_result.update(vocab_size=len(tokenizer), prompt_tokens_mean=mean_prompt)
    print(f"[{shape}] {len(rows)} prompts of {mean_prompt:.0f} tokens on average", flush=True)
    bench.save()

    server = None
    t0 = time.perf_counter()
    if args.server == "vllm":
        url = args.vllm_url
        mine = _process_tree(os.getpid())  # the trainer and its rollout process; vLLM is everything else

        def is_server(pid: int) -> bool:
            return pid not in mine
    else:
        serve_args = ["--dtype", "bfloat16" if bench.device == "cuda" else "float32",
                      "--max-model-len", str(preset["max_model_len"]),
                      "--max-num-seqs", str(args.max_num_seqs)]
        if bench.device == "cuda":
            serve_args += ["--gpu-memory-utilization", str(args.gpu_memory_utilization)]
        if args.sharing == "in-process":  # the server's threads in this process: its memory counts as ours
            print(f"[{shape}] starting the embedded server in this process on {bench.device}", flush=True)
            server = ServerThread(ServeConfig.of(str(model_dir), "--device", bench.device, "--port",
                                                 str(free_port()), *serve_args))
            url = server.start(timeout_s=args.server_start_timeout).url
            shape_result["server_log"] = None

            def is_server(pid: int) -> bool:
                return False
        else:
            log = Path(args.work_dir) / f"server-{shape}.log"
            shape_result["server_log"] = str(log)
            print(f"[{shape}] starting the embedded server on {bench.device} (log: {log})", flush=True)
            server = EmbeddedServer(str(model_dir), device=bench.device, extra_args=serve_args, log_path=log,
                                    startup_timeout_s=args.server_start_timeout)
            url = server.start().url
            server_tree = _process_tree(server.process.pid)

            def is_server(pid: int) -> bool:
                return pid in server_tree
        shape_result["server_args"] = serve_args
    shape_result["server_start_s"] = time.perf_counter() - t0
    shape_result["server_config"] = server_cache_config(url)
    try:
        for repeat in range(args.repeats):
            order = SETTINGS if repeat % 2 == 0 else SETTINGS[::-1]  # ABBA: drift spreads over both
            for setting in order:
                left = args.deadline_s - (time.perf_counter() - bench.started) if args.deadline_s else None
                if left is not None and left < args.max_seconds + 60:
                    shape_result["runs"].append({"setting": setting[0], "repeat": repeat,
                                                 "status": f"skipped: {left:.0f} s left of --deadline-s"})
                    continue
                train_once(bench, shape, preset, setting, repeat, url, model_dir, rows, is_server)
        shape_result["comparison"] = compare_settings(shape_result["runs"])
    except BaseException:
        if server is not None and shape_result["server_log"]:
            shape_result["server_log_tail"] = _tail(Path(shape_result["server_log"]))
        raise
    finally:
        if server is not None:
            server.stop()
        bench.save()


def _process_tree(pid: int) -> set[int]:
    """`pid` and its descendants (just `pid` without psutil, or once it ended)."""
    try:
        import psutil
    except ImportError:
        return {pid}
    try:
        return {pid, *(c.pid for c in psutil.Process(pid).children(recursive=True))}
    except psutil.Error:
        return {pid}


def _tail(path: Path, chars: int = 4000) -> str:
    try:
        return path.read_text(errors="replace")[-chars:]
    except OSError as exc:
        return f"(no server log: {exc})"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    from asyncgrpo.cli_args import auto_bool
    from asyncgrpo.config_rules import FLEX_BACKENDS

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", nargs="+", choices=sorted(PRESETS), default=["0.6b", "1.7b"])
    p.add_argument("--server", choices=("embedded", "vllm"), default="embedded")
    p.add_argument("--vllm-url", default=None,
                   help="A running vLLM 0.33 with the ipc backend (--server vllm).")
    p.add_argument("--device", default="auto", help="auto (cuda if there is one), cuda or cpu.")
    p.add_argument("--model-dir", default=None,
                   help="The checkpoint (built there if missing); one shape only.")
    p.add_argument("--build-only", action="store_true", help="Build the checkpoint(s) and exit.")
    p.add_argument("--work-dir", default="/tmp/asyncgrpo-one-gpu",
                   help="Checkpoints, server logs, output dirs.")
    p.add_argument("--max-seconds", type=float, default=60.0,
                   help="Per run: seconds measured after the warm-up steps (the steady window).")
    p.add_argument("--grace-s", type=float, default=180.0,
                   help="Per run, for start-up, warm-up (compilation) and shutdown: a run still going "
                   "--max-seconds + --grace-s after it started ends the process (JSON says where).")
    p.add_argument("--deadline-s", type=float, default=None,
                   help="Seconds for the whole command: a run is not started unless --max-seconds + 60 are "
                   "left.")
    p.add_argument("--warmup-steps", type=int, default=3)
    p.add_argument("--repeats", type=int, default=1, help="Pairs of runs per shape (ABBA order).")
    p.add_argument("--max-steps", type=int, default=100_000, help="Runs stop on time before this.")
    for key in PRESETS["0.6b"]:
        p.add_argument(f"--{key.replace('_', '-')}", type=int, default=None,
                       help="Default: the shape's preset.")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.35, help="The embedded server's share.")
    p.add_argument("--sharing", choices=SHARING_MODES, default="time-slicing",
                   help="How trainer and server share the GPU: two processes time-sliced by CUDA, two "
                   "processes under an MPS daemon, or the embedded server inside the trainer's process (its "
                   "own stream).")
    p.add_argument("--keep-kv-across-syncs", action="store_true",
                   help="AsyncGRPOConfig.keep_kv_across_syncs: a sync keeps the KV of the rollouts in "
                   "flight.")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--server-start-timeout", type=float, default=600.0)
    p.add_argument("--learning-rate", type=float, default=1e-6)
    p.add_argument("--no-gradient-checkpointing", action="store_true")
    p.add_argument("--torch-compile", type=auto_bool, nargs="?", const=True, default=None,
                   help="The trainer's torch_compile: auto (the default: compiled decoder layers and fused "
                   "log-prob head where the start-up probe passes), on (the bare flag) or off.")
    p.add_argument("--activation-memory-budget", type=float, default=None,
                   help="The trainer's activation_memory_budget (compiled layers): selective recomputation.")
    p.add_argument("--flex-attention-backend", choices=FLEX_BACKENDS, default="auto",
                   help="The trainer's flex_attention_backend (compiled layers): 'flash' is "
                   "FlashAttention-4, 'auto' (the default) picks it where it runs.")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", default=None)
    args = p.parse_args(argv)
    if args.server == "vllm" and not (args.vllm_url and args.model_dir and len(args.shape) == 1):
        p.error("--server vllm needs --vllm-url, one --shape and the --model-dir that vLLM serves")
    if args.model_dir and len(args.shape) != 1:
        p.error("--model-dir holds one checkpoint: give one --shape")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if args.build_only:
        import torch

        device = ("cuda" if args.device == "auto" and torch.cuda.is_available()
                  else args.device.replace("auto", "cpu"))
        for shape in args.shape:
            prepare_checkpoint(shape, Path(args.model_dir or Path(args.work_dir) / f"qwen3-{shape}-chat"),
                               device)
        return
    with gpu_sharing(args.sharing, Path(args.work_dir)) as sharing:  # before this process touches CUDA
        run_bench(args, sharing)


def run_bench(args: argparse.Namespace, sharing: dict) -> None:
    import torch

    slug = torch.cuda.get_device_name().lower().replace("nvidia ", "").replace(" ", "-") \
        if torch.cuda.is_available() and args.device != "cpu" else "cpu"
    suffix = (("_vllm" if args.server == "vllm" else "")
              + {"mps": "_mps", "in-process": "_inprocess"}.get(args.sharing, "")
              + ("_keepkv" if args.keep_kv_across_syncs else ""))
    output = Path(args.output or Path(__file__).parent / "results" / f"one_gpu_{slug}{suffix}.json")
    bench = Bench(args, output)
    if args.sharing == "in-process" and (bench.device != "cuda" or args.server != "embedded"):
        raise SystemExit("--sharing in-process runs the embedded server inside this process and moves "
                         "weights by CUDA IPC: it needs --server embedded on CUDA (got --server "
                         f"{args.server} on {bench.device})")
    bench.result["sharing"] = sharing
    print(f"one_gpu: {', '.join(args.shape)} on {bench.result['device']}, {args.server} server; "
          f"JSON -> {output}", flush=True)
    try:
        for shape in args.shape:
            run_shape(bench, shape)
        bench.result["status"] = "done"
    except BaseException as exc:
        bench.result["status"] = f"failed: {type(exc).__name__}: {exc}"
        raise
    finally:
        bench.save()
        for shape, r in bench.result["shapes"].items():
            print(f"[{shape}] {json.dumps(r.get('comparison'), indent=1)}", flush=True)
        print(f"wrote {output}", flush=True)


if __name__ == "__main__":
    main()
