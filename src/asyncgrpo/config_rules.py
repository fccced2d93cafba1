"""The rules `AsyncGRPOConfig.__post_init__` applies: settings the trainer refuses, the defaults that
differ from `TrainingArguments`, JSON-string dicts, and the validation of every field.

Each failed rule raises `ValueError` naming the field, its value and what to set instead. The config
module imports this one; the config is only a parameter here, so there is no import cycle.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from transformers import TrainingArguments

if TYPE_CHECKING:
    from asyncgrpo.config import AsyncGRPOConfig

# the warnings are the config's: keep them under the logger name users already filter on
logger = logging.getLogger("asyncgrpo.config")

DTYPES = ("auto", "bfloat16", "float16", "float32")
# flex_attention_backend: FlexAttention's Triton kernels, FlashAttention-4, or the latter where it runs
FLEX_BACKENDS = ("auto", "triton", "flash")
# weight_push: every served weight, or the words changed since the last push
WEIGHT_PUSHES = ("full", "delta")
_TRAINING_ARGUMENT_FIELDS = {f.name for f in dataclasses.fields(TrainingArguments)}


def _parallel_size(config: Any, name: str) -> int:
    value = config.get(name) if isinstance(config, dict) else getattr(config, name, None)
    return int(value or 1)


def reject_unsupported(args: AsyncGRPOConfig) -> None:
    """Settings the trainer cannot honour; checked before TrainingArguments acts on them."""
    if args.deepspeed:
        raise ValueError(
            f"deepspeed={args.deepspeed!r}: DeepSpeed is not supported by AsyncGRPOTrainer; remove it and "
            f"shard with FSDP2 instead (fsdp='full_shard', fsdp_config={{'fsdp_version': 2}})"
        )
    if args.parallelism_config is not None:
        for name in ("cp_size", "sp_size"):
            size = _parallel_size(args.parallelism_config, name)
            if size > 1:
                raise ValueError(
                    f"parallelism_config.{name}={size}: context and sequence parallelism are not supported "
                    f"(packed rows are trees); set {name}=1"
                )
    if args.use_liger_kernel:
        raise ValueError(
            "use_liger_kernel=True is not supported: the loss needs full per-token log-probabilities; "
            "set use_liger_kernel=False"
        )


def _bf16_supported(args: AsyncGRPOConfig) -> bool:
    """Whether TrainingArguments accepts bf16=True here (the same test it applies)."""
    from transformers.utils import is_torch_bf16_gpu_available, is_torch_xla_available

    return bool(args.use_cpu or is_torch_bf16_gpu_available() or is_torch_xla_available())


def resolve_defaults(args: AsyncGRPOConfig) -> None:
    """The defaults that differ from TrainingArguments (listed in the class docstring)."""
    if args.bf16 is None:
        if args.fp16:
            args.bf16 = False
        elif _bf16_supported(args):
            args.bf16 = True
        else:
            args.bf16 = False
            logger.warning(
                "bf16 defaults to True, but no bf16-capable accelerator was found and use_cpu=False, which "
                "transformers refuses; using bf16=False. Set use_cpu=True for CPU training with bf16 "
                "autocast, or bf16=False to silence this warning."
            )
    if "activation_checkpointing" in _TRAINING_ARGUMENT_FIELDS:  # newer transformers: the new name
        if args.activation_checkpointing is None:
            # gradient_checkpointing is this config's own field (the reference's name): no deprecation warning
            args.activation_checkpointing = (True if args.gradient_checkpointing is None
                                             else args.gradient_checkpointing)
            args.gradient_checkpointing = None
    elif args.gradient_checkpointing is None:
        args.gradient_checkpointing = True
    if args.activation_memory_budget is not None:  # the compiled layers recompute instead (validated below)
        if "activation_checkpointing" in _TRAINING_ARGUMENT_FIELDS:
            args.activation_checkpointing = False
        else:
            args.gradient_checkpointing = False
    if not args.ignore_data_skip:
        logger.warning(
            "ignore_data_skip=False has no effect: AsyncGRPOTrainer resumes from rollout_state.json, not by "
            "replaying batches; using ignore_data_skip=True."
        )
        args.ignore_data_skip = True


def parse_dict(name: str, value: Any) -> dict[str, Any] | None:
    """A dict field given as a JSON string (command line) -> dict."""
    if value is None or isinstance(value, dict):
        return value
    if isinstance(value, str):
        try:
            parsed = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(
                f"{name}={value!r} is not valid JSON ({exc.msg}); pass a dict or a JSON object string such "
                f"as '{{\"enable_thinking\": false}}'"
            ) from None
        if isinstance(parsed, dict):
            return parsed
    raise ValueError(f"{name} must be a dict (or a JSON object string), got {type(value).__name__} {value!r}")


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def server_url_problem(url: str) -> str | None:
    """What is wrong with a server's base URL, or None: it must be one http(s) URL with a host and a valid
    port. Anything else fails only at the first request, with an HTTP client's error that names neither the
    setting nor the fix."""
    example = "such as 'http://localhost:8000'"
    if not isinstance(url, str) or "://" not in url:
        return f"needs a scheme: pass {'http://' + str(url)!r}"
    if "," in url or url.count("://") > 1:
        first = url.split(",")[0].strip()
        return f"is several URLs in one string; pass one URL here, e.g. {first!r}"
    if url != url.strip() or any(c.isspace() for c in url):
        return f"contains a space; pass the URL without spaces, {example}"
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:  # a port that is no number in 0..65535, a bracket left open
        what = "port" if "port" in str(exc).lower() else "IPv6 address" if "IPv6" in str(exc) else "form"
        return f"has an invalid {what} ({exc}); pass a URL {example}"
    del port
    if parts.scheme not in ("http", "https"):
        return "the server speaks HTTP; pass an http:// or https:// URL such as 'http://localhost:8000'"
    if not parts.hostname:
        return f"has no host; pass one {example}"
    return None


def server_urls(value: str | Sequence[str]) -> list[str]:
    """`vllm_server_base_url` as the list of servers it names: one URL, or the list given (validated by
    `server_urls_problem` when the config was built)."""
    return [value] if isinstance(value, str) else list(value)


def _same_server_key(url: str) -> tuple[str, str, int | None, str]:
    """What makes two valid URLs name one server: the scheme, the host (case-insensitive), the port (the
    scheme's default when absent) and the path without its trailing slash."""
    parts = urlsplit(url)
    port = parts.port or {"http": 80, "https": 443}.get(parts.scheme)
    return parts.scheme, (parts.hostname or "").lower(), port, parts.path.rstrip("/")


def _joined_urls_problem(text: str) -> str:
    """What to write instead of several URLs joined by commas in one string."""
    urls = [u.strip() for u in text.split(",") if u.strip()]
    return (f"is several URLs in one string; pass them as a list, vllm_server_base_url={urls!r} (on the "
            f"command line: --vllm_server_base_url {' '.join(urls)})")


def server_urls_problem(value: Any) -> str | None:
    """What is wrong with `vllm_server_base_url` (one URL, or a non-empty list of distinct ones), or None;
    the message starts with the field and the value it names."""
    field_name = "vllm_server_base_url"
    if isinstance(value, str):
        problem = server_url_problem(value)
        if problem is not None and "several URLs" in problem:
            problem = _joined_urls_problem(value)
        return None if problem is None else f"{field_name}={value!r}: {problem}"
    if not isinstance(value, (list, tuple)):
        return (f"{field_name}={value!r} must be a URL string or a list of them, got {type(value).__name__}; "
                "e.g. 'http://localhost:8000' or ['http://host-a:8000', 'http://host-b:8000']")
    if not value:
        return (f"{field_name}=[] names no server; pass at least one URL, e.g. 'http://localhost:8000' (or a "
                "list of several to spread generation over them)")
    for i, url in enumerate(value):
        if not isinstance(url, str):
            return f"{field_name}[{i}]={url!r} must be a URL string, got {type(url).__name__}"
        problem = server_url_problem(url)
        if problem is not None and "several URLs" in problem:
            problem = _joined_urls_problem(url)
        if problem is not None:
            return f"{field_name}[{i}]={url!r}: {problem}"
    seen: dict[tuple, int] = {}
    for i, url in enumerate(value):
        first = seen.setdefault(_same_server_key(url), i)
        if first != i:
            return (
                f"{field_name} lists one server twice: [{first}]={value[first]!r} and [{i}]={url!r}; list "
                "each server once (the trainer pushes the weights to every entry, one lease per server)"
            )
    return None


def validate(args: AsyncGRPOConfig) -> None:
    """Every field's rules, in declaration order: a broken rule raises, a no-op combination warns."""
    # two of TrainingArguments' fields that it takes as they come
    _require(args.learning_rate >= 0, f"learning_rate={args.learning_rate} must be >= 0: a negative one "
             "climbs the loss; use a small positive value such as 1e-6 (0 trains nothing)")
    _require(args.gradient_accumulation_steps >= 1,
             f"gradient_accumulation_steps={args.gradient_accumulation_steps} must be >= 1 "
             "(micro-batches per step)")
    _require(args.dtype in DTYPES, f"dtype={args.dtype!r} is not one of {DTYPES}; pick one of them")
    budget = args.activation_memory_budget
    _require(budget is None or 0 < budget <= 1,
             f"activation_memory_budget={budget} must be in (0, 1] (the fraction of activation memory the "
             "compiled layers keep; e.g. 0.5), or None for whole-layer gradient_checkpointing")
    _require(budget is None or bool(args.torch_compile),
             f"activation_memory_budget={budget} is the compiled layers' recomputation: set "
             "torch_compile=True as well, or leave activation_memory_budget=None for whole-layer "
             "gradient_checkpointing")
    _require(args.flex_attention_backend in FLEX_BACKENDS,
             f"flex_attention_backend={args.flex_attention_backend!r} is not one of {FLEX_BACKENDS}; "
             "pick one of them")
    _require(args.flex_attention_backend != "flash" or args.torch_compile is not False,
             "flex_attention_backend='flash' runs in the compiled layers: leave torch_compile at None or set "
             "it True, or set flex_attention_backend='triton'")
    _require(
        args.router_aux_loss_coef is None or args.router_aux_loss_coef >= 0,
        f"router_aux_loss_coef={args.router_aux_loss_coef} must be >= 0 (0.0 disables it) or None",
    )
    _require(
        args.num_generations >= 2,
        f"num_generations={args.num_generations}: a group needs at least 2 rollouts to compute an advantage "
        f"(advantages are standardised within the group); set num_generations >= 2",
    )
    _require(args.max_completion_length >= 1,
             f"max_completion_length={args.max_completion_length} must be >= 1")
    _require(
        args.temperature > 0,
        f"temperature={args.temperature} must be > 0: importance ratios compare the trainer's probabilities "
        f"with the sampler's sampling distribution, which greedy decoding (temperature 0) does not have; use "
        f"a positive temperature such as 1.0",
    )
    _require(0 < args.top_p <= 1,
             f"top_p={args.top_p} must be in (0, 1]; use 1.0 to disable nucleus sampling")
    _require(args.top_k >= 0, f"top_k={args.top_k} must be >= 0; use 0 (not -1) to disable top-k")
    _require(
        args.min_p is None or 0 <= args.min_p <= 1,
        f"min_p={args.min_p} must be in [0, 1], or None to disable it",
    )
    truncation = [f"top_p={args.top_p}"] if args.top_p < 1 else []
    truncation += [f"min_p={args.min_p}"] if args.min_p else []
    _require(
        not truncation or args.top_k > 0,
        f"{' and '.join(truncation)} needs top_k > 0 (got top_k={args.top_k}): the trainer renormalizes over "
        "the sampler's candidate set, which is only bounded with top-k; set top_k (e.g. 50) as well",
    )
    _require(
        args.repetition_penalty == 1.0,
        f"repetition_penalty={args.repetition_penalty} is not supported: the sampler's log-probs include the "
        "penalty and the trainer's do not, which biases every importance ratio of both objectives (score "
        "centering and the clipped surrogate); set repetition_penalty=1.0",
    )
    _require(
        args.max_tool_calling_iterations is None or args.max_tool_calling_iterations >= 0,
        f"max_tool_calling_iterations={args.max_tool_calling_iterations} must be >= 0, or None for no limit",
    )
    _require(
        args.tool_call_timeout > 0,
        f"tool_call_timeout={args.tool_call_timeout} must be > 0 seconds (a hung tool call would otherwise "
        "hang its rollout forever); use a large value for slow tools",
    )
    problem = server_urls_problem(args.vllm_server_base_url)
    _require(problem is None, str(problem))
    _require(args.vllm_server_timeout > 0,
             f"vllm_server_timeout={args.vllm_server_timeout} must be > 0 seconds")
    _require(args.vllm_server_restart_timeout >= 0,
             f"vllm_server_restart_timeout={args.vllm_server_restart_timeout} must be >= 0 seconds "
             "(0: do not wait)")
    _require(
        0 < args.epsilon < 1,
        f"epsilon={args.epsilon} must be in (0, 1) so that the trust region [1 - epsilon, 1 + epsilon_high] "
        "is non-empty and positive",
    )
    _require(
        args.epsilon_high is None or args.epsilon_high > 0,
        f"epsilon_high={args.epsilon_high} must be > 0, or None to use epsilon={args.epsilon}",
    )
    c_min, c_max = args.vllm_importance_sampling_clip_min, args.vllm_importance_sampling_clip_max
    _require(
        0 <= c_min < 1 < c_max,
        f"vllm_importance_sampling_clip_min={c_min} and vllm_importance_sampling_clip_max={c_max} must "
        "satisfy 0 <= clip_min < 1 < clip_max: tokens whose ratio falls outside are masked, so an on-policy "
        "ratio of 1 must be inside (defaults: 0.5 and 5.0)",
    )
    _require(args.num_sampler_logprobs >= 0, f"num_sampler_logprobs={args.num_sampler_logprobs} must be >= 0")
    if args.score_centering and args.num_sampler_logprobs == 0:
        logger.warning(
            "score_centering=True with num_sampler_logprobs=0: the expectation is taken over no token, so "
            "score centering does nothing; set num_sampler_logprobs >= 1 or score_centering=False."
        )
    _require(
        args.token_budget is None or args.token_budget >= 1,
        f"token_budget={args.token_budget} must be >= 1, or None to use the server's max_model_len",
    )
    _require(
        args.max_concurrent_rollouts >= 1,
        f"max_concurrent_rollouts={args.max_concurrent_rollouts} must be >= 1",
    )
    _require(
        args.max_staleness >= 0,
        f"max_staleness={args.max_staleness} must be >= 0 (0 trains only samples of the current weights)",
    )
    _require(args.weight_sync_steps >= 1, f"weight_sync_steps={args.weight_sync_steps} must be >= 1")
    _require(args.weight_push in WEIGHT_PUSHES,
             f"weight_push={args.weight_push!r} is not one of {WEIGHT_PUSHES}: 'full' sends every weight, "
             "'delta' the words changed since the last push")
    _require(
        args.rollout_worker_timeout > 0,
        f"rollout_worker_timeout={args.rollout_worker_timeout} must be > 0 seconds",
    )
    _require(args.harness_timeout > 0, f"harness_timeout={args.harness_timeout} must be > 0 seconds")
    _require(
        args.max_concurrent_harnesses is None or args.max_concurrent_harnesses >= 1,
        f"max_concurrent_harnesses={args.max_concurrent_harnesses} must be >= 1, or None to use "
        "max_concurrent_rollouts",
    )
    _require(
        args.num_completions_to_print is None or args.num_completions_to_print >= 0,
        f"num_completions_to_print={args.num_completions_to_print} must be >= 0, or None to print all",
    )
