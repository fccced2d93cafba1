"""Which weight transport the trainer uses, from where it trains and what the server reports.

    trainer on CPU                                  -> "gloo"
    trainer on CUDA, server on CPU (embedded)       -> "gloo"   (staged through host memory)
    trainer and server on the same GPU              -> "ipc"    (embedded server, JSON handles)
                                                    -> "vllm_ipc" (vLLM started with the ipc backend)
    trainer on CUDA, server on another GPU          -> "nccl"
    same GPU but the server takes no IPC, or vLLM's ipc backend without the trainer on its GPU
                                                    -> ValueError saying what to restart with

NCCL refuses two ranks on one GPU (`ncclCommInitRank ... invalid usage`), hence IPC there. The
embedded server reports its GPU's UUID; vLLM does not, so with vLLM "same GPU" is known only when
this host has a single GPU (all visible to the trainer) and the server is local. `choose_transport`
is pure; `same_gpu` gathers the facts.
"""

from __future__ import annotations

import ipaddress
import os
import socket
from urllib.parse import urlparse

from asyncgrpo.generation.server_info import ServerDevice

VLLM_IPC_RESTART = (
    "VLLM_ALLOW_INSECURE_SERIALIZATION=1 VLLM_SERVER_DEV_MODE=1 vllm serve MODEL "
    "--weight-transfer-config '{\"backend\": \"ipc\"}' --gpu-memory-utilization 0.4 ..."
)
INSECURE_RISK = (
    "vLLM's ipc backend unpickles the handles it receives, so with VLLM_ALLOW_INSECURE_SERIALIZATION=1 anyone "
    "who can reach the server's port can run code in it: bind it to 127.0.0.1 (the default) on a trusted host"
)


def choose_transport(trainer_device_type: str, server: ServerDevice | None, same_gpu: bool | None) -> str:
    """"gloo", "nccl", "ipc" or "vllm_ipc" (module doc); `same_gpu` None means unknown."""
    if server is not None and not server.embedded and server.transfer_backend == "ipc":
        if trainer_device_type != "cuda" or same_gpu is False:
            raise ValueError(
                "vLLM runs the ipc weight-transfer backend, which takes weights only from a CUDA trainer on its own "
                "GPU, and this trainer is not on it: train on the server's GPU, or restart vLLM with "
                "--weight-transfer-config '{\"backend\": \"nccl\"}' for a trainer on another GPU"
            )
        if not server.insecure_serialization:
            raise ValueError(
                "vLLM runs the ipc weight-transfer backend but without VLLM_ALLOW_INSECURE_SERIALIZATION=1, so it "
                f"will refuse the trainer's handles: restart it as `{VLLM_IPC_RESTART}`. Risk: {INSECURE_RISK}"
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
            "the trainer and the embedded server share one GPU, where NCCL cannot connect them, and this server "
            "takes no CUDA IPC weights: upgrade asyncgrpo on the server side and restart `asyncgrpo serve`, or put "
            "the server on another GPU (--device cuda:1)"
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
        return ("the embedded server shares this GPU from another process, so CUDA time-slices the two: run it "
                "inside the trainer's process with asyncgrpo.server.serve.ServerThread for more throughput (measured "
                "in docs/performance.md, 'One GPU')")
    return ("vLLM shares this GPU from another process, so CUDA time-slices the two; the embedded server can run "
            "inside the trainer's process instead (measured in docs/performance.md, 'One GPU')")


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
    host = urlparse(url).hostname or ""
    try:
        return ipaddress.ip_address(socket.gethostbyname(host)).is_loopback
    except (OSError, ValueError):
        return False


def nccl_failure_hint(message: str) -> str | None:
    """What to tell the user when NCCL could not form the group: two ranks on one GPU are refused."""
    if "invalid usage" not in message:
        return None
    return (
        "NCCL refuses two ranks on one GPU: the server most likely runs on the trainer's GPU. Use CUDA IPC instead: "
        f"for vLLM restart it as `{VLLM_IPC_RESTART}` (risk: {INSECURE_RISK}); the embedded server does it by itself "
        "when it reports its GPU (`asyncgrpo serve` of this version)"
    )
