"""What the inference server says about itself, parsed: `/version`, `/v1/models`, `/server_info`
(`?config_format=json`: limits, dtype, log-prob mode, LoRA, device and weight-transfer backend),
`/get_world_size` and `/metrics`. Pure, like `protocol.py`: dicts and strings in, frozen dataclasses
out; a body that lacks what the client relies on raises `ProtocolError`.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from asyncgrpo.generation.protocol import ProtocolError


def parse_version(body: dict[str, Any]) -> tuple[str, tuple[int, int, int]]:
    """`{"version": "0.33.0"}` -> ("0.33.0", (0, 33, 0)); suffixes such as `+embedded` are kept in
    the string and ignored in the tuple."""
    version = str(body.get("version", "")) if isinstance(body, dict) else ""
    m = re.match(r"^v?(\d+)\.(\d+)(?:\.(\d+))?", version)
    if m is None:
        raise ProtocolError(f"/version: cannot read a version from {body!r}")
    return version, (int(m.group(1)), int(m.group(2)), int(m.group(3) or 0))


def parse_models(body: dict[str, Any]) -> tuple[str, int | None]:
    """The base model card (the first without a `parent`): its id and `max_model_len`."""
    cards = body.get("data") if isinstance(body, dict) else None
    if not cards:
        raise ProtocolError(f"/v1/models: no model cards in {json.dumps(body)[:300]}")
    base = next((c for c in cards if not c.get("parent")), cards[0])
    mml = base.get("max_model_len")
    return str(base["id"]), int(mml) if mml is not None else None


@dataclass(frozen=True)
class LoraServing:
    """The server's LoRA limits (`vllm_config.lora_config`, set by --enable-lora) and whether adapters
    can be loaded at run time (vLLM: `VLLM_ALLOW_RUNTIME_LORA_UPDATING`; the embedded server always can)."""

    max_lora_rank: int
    max_loras: int
    runtime_updating: bool


@dataclass(frozen=True)
class ServerConfig:
    """The parts of `/server_info?config_format=json` the trainer uses."""

    max_model_len: int | None
    dtype: str | None
    logprobs_mode: str | None
    return_sampling_mask: bool
    kv_cache_tokens: int | None
    lora: LoraServing | None = None
    device: ServerDevice | None = None


@dataclass(frozen=True)
class ServerDevice:
    """Where the server computes and how it takes weights (for choosing the weight transport).

    `device_uuid`: the GPU's UUID (`torch.cuda.get_device_properties(i).uuid`); the embedded server
    reports it on CUDA, vLLM does not. `transfer_backend`: vLLM's `--weight-transfer-config` backend
    (the embedded server: its default). `accepts_ipc`: the server copies weights from CUDA IPC handles
    (vLLM: backend "ipc"; the embedded server: its JSON IPC path). `insecure_serialization`: vLLM's
    `VLLM_ALLOW_INSECURE_SERIALIZATION` (its ipc backend unpickles the handles only with it). `pid`: the
    embedded server's process id (equal to the trainer's when it runs inside it), None for vLLM.
    `accepts_deltas`: /update_weights takes a delta of the changed words over NCCL or gloo (the embedded
    server's extension, `asyncgrpo.sync.delta`; vLLM does not). `instance_id`: a name the embedded
    server draws at start, the same through every address that reaches it (None for vLLM)."""

    device_type: str | None
    device_uuid: str | None
    transfer_backend: str | None
    accepts_ipc: bool
    embedded: bool
    insecure_serialization: bool = False
    pid: int | None = None
    accepts_deltas: bool = False
    instance_id: str | None = None


def parse_server_device(body: dict[str, Any]) -> ServerDevice:
    config = body.get("vllm_config") or {}
    device = config.get("device_config") or {}
    transfer = config.get("weight_transfer_config") or {}
    env = body.get("vllm_env") or {}
    embedded = body.get("embedded")
    backend = transfer.get("backend") if isinstance(transfer, dict) else None
    if isinstance(embedded, dict):
        accepts_ipc = "ipc" in (embedded.get("weight_transfer_backends") or [])
    else:
        accepts_ipc = backend == "ipc"
    uuid = device.get("device_uuid")
    return ServerDevice(
        device_type=device.get("device_type") or device.get("device"),
        device_uuid=str(uuid) if uuid else None,
        transfer_backend=backend,
        accepts_ipc=accepts_ipc,
        embedded=isinstance(embedded, dict),
        insecure_serialization=str(env.get("VLLM_ALLOW_INSECURE_SERIALIZATION", "")).lower() in ("1", "true"),
        pid=(embedded.get("pid") if isinstance(embedded, dict) and isinstance(embedded.get("pid"), int)
             else None),
        accepts_deltas=isinstance(embedded, dict) and embedded.get("weight_deltas") is True,
        instance_id=(embedded.get("instance_id") if isinstance(embedded, dict)
                     and isinstance(embedded.get("instance_id"), str) else None),
    )


def parse_server_info(body: dict[str, Any]) -> ServerConfig:
    """dtype is returned as a torch attribute name (`"torch.bfloat16"` -> `"bfloat16"`); the KV cache
    size is `kv_cache_size_tokens`, else `num_gpu_blocks * block_size`."""
    config = body.get("vllm_config") if isinstance(body, dict) else None
    if not isinstance(config, dict):
        raise ProtocolError("/server_info: no 'vllm_config' object (ask with ?config_format=json)")
    model = config.get("model_config") or {}
    cache = config.get("cache_config") or {}
    dtype = model.get("dtype")
    if isinstance(dtype, str) and dtype.startswith("torch."):
        dtype = dtype[len("torch.") :]
    kv_tokens = cache.get("kv_cache_size_tokens")
    if kv_tokens is None and cache.get("num_gpu_blocks") and cache.get("block_size"):
        kv_tokens = int(cache["num_gpu_blocks"]) * int(cache["block_size"])
    mml = model.get("max_model_len")
    lora = config.get("lora_config")
    env = body.get("vllm_env") or {}
    return ServerConfig(
        max_model_len=int(mml) if mml is not None else None,
        dtype=dtype,
        logprobs_mode=model.get("logprobs_mode"),
        return_sampling_mask=bool(model.get("return_sampling_mask", False)),
        kv_cache_tokens=int(kv_tokens) if kv_tokens is not None else None,
        # vLLM always lists the variable (a bool); the embedded server lists none and needs none
        lora=LoraServing(int(lora["max_lora_rank"]), int(lora["max_loras"]),
                         bool(env.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING", True)))
        if isinstance(lora, dict) else None,
        device=parse_server_device(body),
    )


def parse_world_size(body: dict[str, Any]) -> int:
    if not isinstance(body, dict) or not isinstance(body.get("world_size"), int) or body["world_size"] < 1:
        raise ProtocolError(f"/get_world_size: expected {{'world_size': int >= 1}}, got {body!r}")
    return body["world_size"]


@dataclass(frozen=True)
class ServerInfo:
    """What `GenerationClient.detect()` learned about the server."""

    version: str
    dialect: tuple[int, int, int]
    model_name: str
    max_model_len: int | None
    dtype: str | None
    logprobs_mode: str | None
    supports_generate: bool
    supports_sampling_mask: bool
    has_metrics: bool
    kv_cache_tokens: int | None
    world_size: int | None
    dev_mode: bool = field(default=False)
    """True when the RL/dev routes (`/server_info`, `/pause`, weight transfer) answered."""
    lora: LoraServing | None = None
    """The server's LoRA serving (None: no --enable-lora, or no /server_info)."""
    device: ServerDevice | None = None
    """The server's device and weight-transfer backends (None: no /server_info)."""


# --------------------------------------------------------------------------------------------------
# GET /metrics
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ServerMetrics:
    """Load of the server. Counts are summed over `engine` labels; the KV-cache usage is the maximum
    over engines (a fraction 0..1). A series the server does not export is None."""

    kv_cache_usage_frac: float | None
    num_requests_running: float | None
    num_requests_waiting: float | None
    num_preemptions: float | None
    # prompt tokens looked up in the prefix cache and, of those, found cached (counters; None
    # when the server runs without prefix caching metrics)
    prefix_cache_queries: float | None = None
    prefix_cache_hits: float | None = None
    # tokens generated and prompt tokens computed since the server started (counters)
    generation_tokens: float | None = None
    prompt_tokens: float | None = None


_METRIC_SUMS = {
    "vllm:num_requests_running": "num_requests_running",
    "vllm:num_requests_waiting": "num_requests_waiting",
    "vllm:num_preemptions_total": "num_preemptions",
    "vllm:prefix_cache_queries_total": "prefix_cache_queries",
    "vllm:prefix_cache_hits_total": "prefix_cache_hits",
    "vllm:generation_tokens_total": "generation_tokens",
    "vllm:prompt_tokens_total": "prompt_tokens",
}


def parse_metrics(text: str) -> ServerMetrics:
    values: dict[str, float] = {}
    kv: float | None = None
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "vllm:kv_cache_usage_perc":
                kv = sample.value if kv is None else max(kv, sample.value)
            elif sample.name in _METRIC_SUMS:
                key = _METRIC_SUMS[sample.name]
                values[key] = values.get(key, 0.0) + sample.value
    return ServerMetrics(
        kv_cache_usage_frac=kv,
        num_requests_running=values.get("num_requests_running"),
        num_requests_waiting=values.get("num_requests_waiting"),
        num_preemptions=values.get("num_preemptions"),
        prefix_cache_queries=values.get("prefix_cache_queries"),
        prefix_cache_hits=values.get("prefix_cache_hits"),
        generation_tokens=values.get("generation_tokens"),
        prompt_tokens=values.get("prompt_tokens"),
    )
