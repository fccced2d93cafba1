"""Weight transport selection (train/weights/choose.py) from /server_info bodies as the servers send them."""

from __future__ import annotations

import pytest

from asyncgrpo.generation.server_info import parse_server_device, parse_server_info
from asyncgrpo.train.weights.choose import choose_transport, same_gpu, sharing_hint
from asyncgrpo.train.weights.collective import nccl_failure_hint

GPU_A = "5c1e0f3a-0000-4000-8000-00000000000a"
GPU_B = "5c1e0f3a-0000-4000-8000-00000000000b"


def embedded_body(
    device_type: str = "cuda", uuid: str | None = GPU_A, ipc: bool = True, pid: int = 4242
) -> dict:
    device = {"device": device_type, "device_type": device_type}
    if uuid is not None:
        device["device_uuid"] = uuid
    backends = ["nccl", "gloo", "ipc"] if ipc else ["nccl", "gloo"]
    return {
        "vllm_config": {"model_config": {"max_model_len": 512, "dtype": "bfloat16"}, "device_config": device,
                        "weight_transfer_config": {"backend": "nccl"}},
        "vllm_env": {}, "system_env": {}, "embedded": {"weight_transfer_backends": backends, "pid": pid},
    }


def vllm_body(backend: str = "nccl", insecure: bool = False) -> dict:
    return {
        "vllm_config": {"model_config": {"max_model_len": 4096, "dtype": "torch.bfloat16"},
                        "device_config": {"device": "cuda", "device_type": "cuda"},
                        "weight_transfer_config": {"backend": backend}},
        "vllm_env": {"VLLM_ALLOW_INSECURE_SERIALIZATION": insecure, "VLLM_SERVER_DEV_MODE": True},
        "system_env": {},
    }


def test_server_info_carries_the_device_to_the_client():
    device = parse_server_info(embedded_body()).device
    assert (
        device.embedded
        and device.device_uuid == GPU_A
        and device.accepts_ipc
        and device.device_type == "cuda"
    )
    device = parse_server_info(vllm_body("ipc", insecure=True)).device
    assert (
        not device.embedded
        and device.device_uuid is None
        and device.accepts_ipc
        and device.insecure_serialization
    )
    assert not parse_server_device(vllm_body("nccl")).accepts_ipc


def test_server_info_says_whether_the_server_takes_weight_deltas():
    assert not parse_server_device(embedded_body()).accepts_deltas  # an embedded server that predates them
    newer = embedded_body()
    newer["embedded"]["weight_deltas"] = True
    assert parse_server_device(newer).accepts_deltas
    assert not parse_server_device(vllm_body()).accepts_deltas


def test_cpu_trainer_uses_gloo():
    assert choose_transport("cpu", parse_server_device(embedded_body("cpu", None, ipc=False)), None) == "gloo"
    assert choose_transport("cpu", parse_server_device(embedded_body()), None) == "gloo"


def test_cuda_trainer_on_another_gpu_uses_nccl():
    server = parse_server_device(embedded_body(uuid=GPU_B))
    shared = same_gpu(GPU_A, server, "http://127.0.0.1:8000", 8, True)
    assert shared is False
    assert choose_transport("cuda", server, shared) == "nccl"


def test_same_gpu_embedded_server_uses_ipc():
    server = parse_server_device(embedded_body(uuid=GPU_A))
    shared = same_gpu(GPU_A, server, "http://10.0.0.7:8000", 8, False)
    assert shared is True
    assert choose_transport("cuda", server, shared) == "ipc"


def test_cuda_trainer_with_a_cpu_embedded_server_uses_gloo():
    server = parse_server_device(embedded_body("cpu", None, ipc=False))
    assert choose_transport("cuda", server, same_gpu(GPU_A, server, "http://127.0.0.1:1", 1, True)) == "gloo"


def test_same_gpu_embedded_server_without_ipc_is_an_error_that_says_restart():
    server = parse_server_device(embedded_body(uuid=GPU_A, ipc=False))
    with pytest.raises(ValueError, match="restart `asyncgrpo serve`"):
        choose_transport("cuda", server, True)


def test_vllm_on_the_only_local_gpu_without_ipc_names_the_restart_flags_and_the_risk():
    server = parse_server_device(vllm_body("nccl"))
    shared = same_gpu(GPU_A, server, "http://localhost:8000", 1, True)
    assert shared is True
    with pytest.raises(ValueError) as err:
        choose_transport("cuda", server, shared)
    text = str(err.value)
    assert "--weight-transfer-config '{\"backend\": \"ipc\"}'" in text
    assert "VLLM_ALLOW_INSECURE_SERIALIZATION=1" in text and "run code" in text


def test_vllm_same_gpu_unknown_falls_back_to_nccl():
    server = parse_server_device(vllm_body("nccl"))
    assert same_gpu(GPU_A, server, "http://localhost:8000", 2, True) is None
    assert same_gpu(GPU_A, server, "http://localhost:8000", 1, False) is None
    assert choose_transport("cuda", server, None) == "nccl"


def test_vllm_ipc_backend_needs_insecure_serialization():
    with pytest.raises(ValueError, match="VLLM_ALLOW_INSECURE_SERIALIZATION=1"):
        choose_transport("cuda", parse_server_device(vllm_body("ipc", insecure=False)), None)
    assert choose_transport("cuda", parse_server_device(vllm_body("ipc", insecure=True)), None) == "vllm_ipc"


def test_vllm_ipc_backend_refuses_a_cpu_trainer():
    with pytest.raises(ValueError, match="backend\": \"nccl\""):
        choose_transport("cpu", parse_server_device(vllm_body("ipc", insecure=True)), None)


def test_no_server_info_keeps_the_collective_default():
    assert choose_transport("cuda", None, same_gpu(GPU_A, None, "http://localhost:1", 1, True)) == "nccl"
    assert choose_transport("cpu", None, None) == "gloo"


def test_nccl_invalid_usage_gets_the_one_gpu_hint():
    hint = nccl_failure_hint("NCCL ncclCommInitRank (rank 0 of 2) failed: invalid usage")
    assert hint is not None and "one GPU" in hint and "ipc" in hint
    assert nccl_failure_hint("connection refused") is None


def test_a_server_sharing_the_gpu_from_another_process_gets_the_in_process_hint():
    own = parse_server_device(embedded_body(pid=7))
    other = parse_server_device(embedded_body(pid=8))
    vllm = parse_server_device(vllm_body("ipc", insecure=True))
    assert own.pid == 7 and vllm.pid is None
    assert sharing_hint("ipc", own, trainer_pid=7) is None  # ServerThread: already side by side
    assert "ServerThread" in sharing_hint("ipc", other, trainer_pid=7)
    assert "time-slices" in sharing_hint("vllm_ipc", vllm, trainer_pid=7)
    assert sharing_hint("nccl", other, trainer_pid=7) is None  # another GPU: nothing shared
