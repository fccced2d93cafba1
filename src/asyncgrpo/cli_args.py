"""The arguments of the `asyncgrpo` commands, below the command line itself: the flags of
`asyncgrpo serve` and the argparse types the commands (and the examples) share.

`asyncgrpo.cli` wires the commands; `asyncgrpo.launch.start_server` parses the same `serve` flags for a
server inside its own process (`serve_arguments`), and the demo takes the types. Nothing here
imports torch or transformers: `asyncgrpo --help` stays instant.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from typing import Any

from asyncgrpo.modeling.lora_rules import ALLOWED_MAX_RANKS

__all__ = ["add_serve_parser", "at_least", "more_than", "serve_arguments", "server_url"]


def add_serve_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add the `serve` command and its flags to `subparsers`; returns its parser."""
    p = subparsers.add_parser(
        "serve",
        help="Start the embedded generation server (a vLLM-compatible subset).",
        description="Serve MODEL over HTTP with the subset of vLLM's protocol that asyncgrpo uses.",
    )
    p.add_argument("model", help="Model id or path, e.g. asyncgrpo/tiny-chat; a .gguf file is converted once "
                   "into a float32 model folder in the cache (needs asyncgrpo[gguf]).")
    p.add_argument("--host", default="127.0.0.1", help="Address to bind (default: 127.0.0.1, local only).")
    p.add_argument("--port", type=_port, default=8000)
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default: cpu).")
    p.add_argument("--dtype", default="auto", help="auto, float32, bfloat16 or float16.")
    p.add_argument("--max-model-len", type=int, default=None, help="Longest prompt + completion (tokens).")
    p.add_argument("--max-num-seqs", type=at_least(1), default=256, help="Most sequences decoded together.")
    p.add_argument("--kv-cache-tokens", type=int, default=None, help="KV-cache size in tokens.")
    p.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=None,
        help="Fraction of the whole GPU the server may use for weights, KV cache and activations, as "
        "vLLM's flag (e.g. 0.4 leaves 60%% to a trainer on the same GPU); sizes the KV cache (CUDA only; "
        "default: the KV cache takes 80%% of the memory free after loading).",
    )
    p.add_argument(
        "--api-key",
        default=os.environ.get("VLLM_API_KEY") or None,
        help="Require `Authorization: Bearer KEY` on every route except /health (default: $VLLM_API_KEY).",
    )
    p.add_argument("--served-model-name", default=None, help="Name reported by /v1/models.")
    p.add_argument("--seed", type=int, default=0, help="Seed for requests that send none.")
    p.add_argument(
        "--max-num-batched-tokens",
        type=at_least(1),
        default=None,
        help="Token budget of one forward pass (decode + prefill; default 8192 on CUDA, 2048 on CPU); longer "
        "prompts are prefilled in chunks, mixed with the running decodes.",
    )
    p.add_argument(
        "--admission-interval",
        type=at_least(1),
        default=1,
        help="While sequences decode, admit waiting requests together every this many steps (a request "
        "waits at most N - 1 steps more), so that requests arriving one by one, e.g. the next turns of "
        "conversations, cost one eager prefill step per N steps instead of one per step (decode-only "
        "steps replay CUDA graphs). Default 1: admit at every step, as vLLM.",
    )
    p.add_argument("--max-logprobs", type=at_least(0), default=20,
                   help="Largest `logprobs` a request may ask for.")
    p.add_argument(
        "--enforce-eager", action="store_true", help="Never replay steps as CUDA graphs (CUDA only)."
    )
    p.add_argument(
        "--async-scheduling",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="Plan and launch each step before the previous one's tokens reach the host, so that the host's "
        "work overlaps the device's, as vLLM's flag (default: on with CUDA, off on CPU, where the device is "
        "the host). A sequence that ends with a stop token costs one dropped row in the next step.",
    )
    p.add_argument(
        "--prompt-attention",
        choices=("auto", "flash_varlen", "padded"),
        default="auto",
        help="How prompt chunks attend: packed for FlashAttention's variable-length kernel (flash_varlen: "
        "CUDA, fp16/bf16, no soft-capped layers) or padded into a batch for SDPA (padded). Default auto: "
        "flash_varlen where its start-up check passes, else padded.",
    )
    p.add_argument(
        "--return-sampling-mask",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="Return per-token candidate sets on the generate route, as vLLM's flag (requests then need "
        "temperature > 0 and top_k > 0).",
    )
    p.add_argument(
        "--profiler-dir",
        default=os.environ.get("VLLM_TORCH_PROFILER_DIR") or None,
        help="Where POST /start_profile and /stop_profile write a torch profiler trace of the engine and a "
        "summary table, as vLLM's VLLM_TORCH_PROFILER_DIR (the default); without it the routes do not exist.",
    )
    p.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="Keep the KV of full blocks after a request ends and reuse it for requests with the same prefix "
        "(a group's shared prompt, a conversation's history), as vLLM's flag (default: on; models with "
        "recurrent layers are served without it).",
    )
    p.add_argument(
        "--weight-transfer-timeout",
        type=more_than(0.0),
        default=300.0,
        help="Seconds a weight-transfer init may take to join the trainer's group, and each receive may wait "
        "for the trainer's data (default 300).",
    )
    p.add_argument(
        "--trainer-lease",
        type=at_least(0.0, float),
        default=30.0,
        help="Seconds a trainer's hold on the server (its pause, its weight-transfer group) lasts without "
        "renewal; then generation resumes and another trainer may take over. 0: no expiry, as vLLM "
        "(default 30).",
    )
    p.add_argument(
        "--enable-lora",
        action="store_true",
        help="Serve LoRA adapters loaded at run time (POST /v1/load_lora_adapter, /v1/unload_lora_adapter; "
        "requests pick one by `model`), as vLLM's flag with VLLM_ALLOW_RUNTIME_LORA_UPDATING=1. CUDA graphs "
        "carry the adapters (each row's adapter slot in a static buffer).",
    )
    p.add_argument(
        "--max-lora-rank",
        type=int,
        default=16,
        choices=ALLOWED_MAX_RANKS,
        help="Largest adapter rank the server accepts (as vLLM: one of %(choices)s; default 16).",
    )
    p.add_argument(
        "--max-loras",
        type=at_least(1),
        default=1,
        help="Adapters loaded at once, each in its own slot (default 1); a load beyond it is refused until "
        "one is unloaded. Every slot costs max-lora-rank rows of every adapted layer, used or not.",
    )
    p.add_argument("--log-level", default="info")
    p.add_argument(
        "--parent-pid",
        type=int,
        default=None,
        help="Shut down when this process, the server's parent, exits (set by "
        "asyncgrpo.launch.EmbeddedServer).",
    )
    return p


def _port(text: str) -> int:
    value = int(text)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"a port is 0 to 65535, got {value}")
    return value


def at_least(minimum: float, kind: type = int) -> Callable[[str], Any]:
    """An argparse type: `kind(text)`, refused below `minimum` with a message naming both."""
    return _checked(kind, lambda value: value >= minimum, f"at least {minimum}")


def more_than(bound: float) -> Callable[[str], float]:
    """An argparse type: a float strictly above `bound`."""
    return _checked(float, lambda value: value > bound, f"more than {bound:g}")


def _checked(kind: type, ok: Callable[[Any], bool], requirement: str) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        value = kind(text)
        if not ok(value):
            raise argparse.ArgumentTypeError(f"must be {requirement}, got {value}")
        return value

    parse.__name__ = kind.__name__  # argparse names the type in "invalid int value: 'x'"
    return parse


AUTO_BOOL = {"auto": None, "on": True, "true": True, "off": False, "false": False}


def auto_bool(text: str) -> bool | None:
    """An argparse type for a field whose None means "where it runs" (`torch_compile`): auto, on or off."""
    value = text.strip().lower()
    if value not in AUTO_BOOL:
        raise argparse.ArgumentTypeError(f"must be auto, on or off, got {text!r}")
    return AUTO_BOOL[value]


def server_url(text: str) -> str:
    """An argparse type: an inference server's http(s) base URL."""
    from asyncgrpo.config_rules import server_url_problem

    problem = server_url_problem(text)
    if problem is not None:
        raise argparse.ArgumentTypeError(f"{text!r} {problem}")
    return text


def serve_arguments(model: str, *flags: str) -> argparse.Namespace:
    """The arguments `asyncgrpo serve MODEL FLAGS...` would run with (a bad flag exits, as on the command
    line)."""
    parser = argparse.ArgumentParser(prog="asyncgrpo")
    add_serve_parser(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(["serve", model, *flags])
