"""The one factory of weight transports: which one this process uses, from where it trains, what it
trains and what the server reports (with several servers, `make_transports`: one transport per server,
each chosen so, and `EveryServer`, every_server.py, over them). `make_transport` is asked once per
server, at start, on rank 0:

    a PEFT model and a server that serves LoRA adapters at run time      -> AdapterSync (adapters.py)
    otherwise the full weights, through the transport for where the two run, wrapped in ServerRestarts:
      trainer on CPU                                  -> "gloo"     CollectiveTransport (collective.py)
      trainer on CUDA, server on CPU (embedded)       -> "gloo"     (staged through host memory)
      trainer and server on the same GPU              -> "ipc"      IpcTransport (ipc.py), embedded server
                                                      -> "vllm_ipc" IpcTransport, vLLM's ipc backend
      trainer on CUDA, server on another GPU          -> "nccl"     CollectiveTransport
      same GPU but the server takes no IPC, or vLLM's ipc backend without the trainer on its GPU
                                                      -> ValueError saying what to restart with

and on the other ranks (no server link) it gives `OtherRank`. NCCL refuses two ranks on one GPU
(`ncclCommInitRank ... invalid usage`), hence IPC there. The embedded server reports its GPU's UUID;
vLLM does not, so with vLLM "same GPU" is known only when this host has a single GPU (all visible to
the trainer) and the server is local. `choose_transport` is pure; `same_gpu` gathers the facts.

With `weight_push="delta"` the collective transport sends weight deltas (delta.py) where the server
takes them; otherwise a warning says why not (`delta_refusal`: vLLM, an older embedded server, a sharded
model; or CUDA IPC, or adapter-only LoRA sync).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlparse

import torch

from asyncgrpo.config import AsyncGRPOConfig
from asyncgrpo.generation.server_info import ServerDevice, ServerInfo
from asyncgrpo.sync.gloo import is_loopback_host
from asyncgrpo.train.server_link import ServerLink, ServerLinks
from asyncgrpo.train.serving import serving_dtype
from asyncgrpo.train.weights.adapters import AdapterSync, choose_lora_sync
from asyncgrpo.train.weights.base import FullWeights, OtherRank, WeightTransport
from asyncgrpo.train.weights.collective import CollectiveTransport
from asyncgrpo.train.weights.every_server import EveryServer
from asyncgrpo.train.weights.gather import is_sharded
from asyncgrpo.train.weights.ipc import INSECURE_RISK, VLLM_IPC_RESTART, IpcTransport
from asyncgrpo.train.weights.restarts import ServerRestarts

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class WeightSettings:
    """The config values the weight push uses, read once (`from_config`)."""

    device: torch.device  # the trainer's: where the weights are sent from
    world_size: int  # training processes (restart recovery is one process's)
    max_staleness: int  # adapter-only sync keeps max_staleness + 1 versions registered
    output_dir: str  # adapter folders go under <output_dir>/.vllm_lora
    timeout_s: float  # vllm_server_timeout (adapter loads; the link's own calls use the link's)
    api_key: str | None
    weight_push: str = "full"  # or "delta": the words changed since the last push

    @classmethod
    def from_config(cls, args: AsyncGRPOConfig) -> WeightSettings:
        return cls(
            device=torch.device(args.device),
            world_size=args.world_size,
            max_staleness=args.max_staleness,
            output_dir=args.output_dir,
            timeout_s=args.vllm_server_timeout,
            api_key=args.vllm_server_api_key,
            weight_push=args.weight_push,
        )


def make_transport(
    link: ServerLink | None,
    info: ServerInfo,
    model: torch.nn.Module,
    settings: WeightSettings,
    *,
    peft_config: Any = None,
) -> WeightTransport:
    """The weight transport of this process (module docstring), not yet `init()`-ed: `link` is rank 0's,
    None on the other ranks; `peft_config` the PEFT config the model was wrapped with (None: not a PEFT
    run). The weights go in the server's dtype. An INFO line says which transport and why; raises
    `ValueError` with the restart flags for a server that cannot take this trainer's weights."""
    dtype = serving_dtype(info)
    if link is None:
        return OtherRank(dtype)
    if peft_config is not None:
        choice = choose_lora_sync(info.lora, peft_config, max_staleness=settings.max_staleness,
                                  sharded=is_sharded(model), server_url=link.base_url)
        logger.info(
            "PEFT weight sync: %s (%s)", "adapter only" if choice.adapter_only else "merged", choice.reason
        )
        if choice.adapter_only:
            if settings.weight_push == "delta":
                logger.warning("weight_push='delta' has no effect with adapter-only LoRA sync: each "
                               "version's adapter is written whole (it is small); set weight_push='full' to "
                               "silence this")
            return AdapterSync(
                link.base_url,
                output_dir=settings.output_dir,
                max_staleness=settings.max_staleness,
                timeout_s=settings.timeout_s,
                dtype=dtype,
                api_key=settings.api_key,
            )
    delta = settings.weight_push == "delta"
    if delta:
        refusal = delta_refusal(info.device, sharded=is_sharded(model))
        if refusal is not None:
            logger.warning("weight_push='delta': %s; every push sends the full weights (set "
                           "weight_push='full' to silence this)", refusal)
            delta = False
    full = full_weight_transport(link, settings.device, dtype, info.device, delta=delta)
    return ServerRestarts(full, link, world_size=settings.world_size)


def delta_refusal(server: ServerDevice | None, *, sharded: bool) -> str | None:
    """Why weight deltas cannot be pushed to this server from this model (None: they can)."""
    if server is None or not server.embedded:
        return ("vLLM takes no weight deltas (they are an extension of the embedded server, `asyncgrpo "
                "serve`)")
    if not server.accepts_deltas:
        return "this embedded server takes no weight deltas (an older asyncgrpo: upgrade it and restart it)"
    if sharded:
        return ("the model is sharded (FSDP2), and the copy of the last push that a delta is taken against "
                "would be the whole model on rank 0")
    return None


def full_weight_transport(link: ServerLink, device: torch.device, dtype: torch.dtype,
                          server: ServerDevice | None, *, delta: bool = False) -> FullWeights:
    """The full-weight transport `choose_transport` picks for this trainer and server (ValueError: a
    setup that cannot work, with what to restart); `delta`: a collective one pushes weight deltas."""
    device = torch.device(device)
    uuid = None
    if device.type == "cuda":
        from asyncgrpo.sync.ipc import gpu_uuid

        uuid = gpu_uuid(device)
    host_gpus = torch.cuda.device_count() if device.type == "cuda" else 0
    shared = same_gpu(uuid, server, link.base_url, host_gpus, all_gpus_visible())
    choice = choose_transport(device.type, server, shared)
    logger.info("weight transport: %s (trainer on %s, same GPU as the server: %s)", choice, device, shared)
    hint = sharing_hint(choice, server, os.getpid())
    if hint is not None:  # a warning where the fix is at hand (the embedded server can move in), else a note
        (logger.warning if server.embedded else logger.info)(hint)
    if delta and choice in ("ipc", "vllm_ipc"):
        logger.warning("weight_push='delta' has no effect over CUDA IPC (the trainer and the server share a "
                       "GPU, where a full push is a copy at memory speed); set weight_push='full' to silence "
                       "this")
    if choice == "ipc":
        return IpcTransport(link, device, dtype, "embedded")
    if choice == "vllm_ipc":
        return IpcTransport(link, device, dtype, "vllm")
    return CollectiveTransport(link, device, dtype, choice, delta=delta)

def choose_transport(trainer_device_type: str, server: ServerDevice | None, same_gpu: bool | None) -> str:
    """"gloo", "nccl", "ipc" or "vllm_ipc" (module doc); `same_gpu` None means unknown."""
    if server is not None and not server.embedded and server.transfer_backend == "ipc":
        if trainer_device_type != "cuda" or same_gpu is False:
            raise ValueError(
                "vLLM runs the ipc weight-transfer backend, which takes weights only from a CUDA trainer on "
                "its own GPU, and this trainer is not on it: train on the server's GPU, or restart vLLM "
                "with --weight-transfer-config '{\"backend\": \"nccl\"}' for a trainer on another GPU"
            )
        if not server.insecure_serialization:
            raise ValueError(
                "vLLM runs the ipc weight-transfer backend but without VLLM_ALLOW_INSECURE_SERIALIZATION=1, "
                f"so it will refuse the trainer's handles: restart it as `{VLLM_IPC_RESTART}`. Risk: "
                f"{INSECURE_RISK}"
            )
        return "vllm_ipc"
    if trainer_device_type != "cuda":
        return "gloo"
    if server is not None and server.embedded and server.device_type not in (None, "cuda"):
        return "gloo"
    if not same_gpu:
        return "nccl"
    if server is not None and server.accepts_ipc:
        return "ipc" if server.embedded else "vllm_ipc"
    if server is not None and server.embedded:
        raise ValueError(
            "the trainer and the embedded server share one GPU, where NCCL cannot connect them, and this "
            "server takes no CUDA IPC weights: upgrade asyncgrpo on the server side and restart `asyncgrpo "
            "serve`, or put the server on another GPU (--device cuda:1)"
        )
    raise ValueError(
        "the trainer and the vLLM server share one GPU, where NCCL cannot connect them (its error is "
        "`ncclCommInitRank ... invalid usage`): restart vLLM with the CUDA IPC weight transfer, as "
        f"`{VLLM_IPC_RESTART}` (lower --gpu-memory-utilization so the trainer keeps the rest of the GPU). "
        f"Risk: {INSECURE_RISK}. Or put the server on another GPU"
    )


def sharing_hint(choice: str, server: ServerDevice | None, trainer_pid: int) -> str | None:
    """What to tell a user whose server shares the trainer's GPU from another process, or None.

    Two processes on one GPU take turns on it (CUDA time-slicing), so the server's decode steps and the
    trainer's kernels never run at the same time; the embedded server inside the trainer's process runs
    its steps on a stream of its own, beside the trainer's (docs/one-gpu.md)."""
    if choice not in ("ipc", "vllm_ipc") or server is None:
        return None
    if server.embedded and server.pid == trainer_pid:
        return None
    if server.embedded:
        return ("the embedded server shares this GPU from another process, so CUDA time-slices the two: run "
                "it inside the trainer's process with asyncgrpo.server.serve.ServerThread for more "
                "throughput (measured in docs/performance.md, 'One GPU')")
    return ("vLLM shares this GPU from another process, so CUDA time-slices the two; the embedded server "
            "can run inside the trainer's process instead (measured in docs/performance.md, 'One GPU')")


def same_gpu(trainer_uuid: str | None, server: ServerDevice | None, server_url: str, host_gpu_count: int,
             all_gpus_visible: bool) -> bool | None:
    """True/False when known: equal UUIDs (embedded server); else, for a local server on a host with
    one GPU that the trainer sees whole, True; otherwise None (unknown)."""
    if trainer_uuid is None or server is None:
        return None
    if server.device_uuid is not None:
        return server.device_uuid == trainer_uuid
    if server.device_type not in (None, "cuda"):
        return False
    if host_gpu_count == 1 and all_gpus_visible and _is_local(server_url):
        return True
    return None


def all_gpus_visible() -> bool:
    """The trainer sees every GPU of the host (CUDA_VISIBLE_DEVICES unset)."""
    return os.environ.get("CUDA_VISIBLE_DEVICES") is None


def _is_local(url: str) -> bool:
    return is_loopback_host(urlparse(url).hostname or "")


def make_transports(
    links: ServerLinks | None,
    infos: Sequence[ServerInfo],
    model: torch.nn.Module,
    settings: WeightSettings,
    *,
    peft_config: Any = None,
) -> WeightTransport:
    """The weight transport of this process for every server of the run (`infos` in the order of
    `vllm_server_base_url`): `make_transport` for each, and with several servers `EveryServer` pushing
    to all of them. `links` is rank 0's (None on the other ranks: one `OtherRank` per server, so that
    they take part in each server's push). One server: its transport alone, as `make_transport` gives it."""
    if links is None:
        transports = [make_transport(None, info, model, settings) for info in infos]
    else:
        assert len(links) == len(infos), "one server description per link"
        transports = [make_transport(link, info, model, settings, peft_config=peft_config)
                      for link, info in zip(links, infos)]
    if len(transports) == 1:
        return transports[0]
    # one training process: a server that stops answering is left out (several must push alike)
    return EveryServer(transports, links, failover=settings.world_size == 1)
