"""The peak FLOP/s that the benchmarks' MFU divides by: the trainer's (`asyncgrpo.train.flops`), so a
benchmark's MFU and the trainer's `perf/*_mfu` agree, and what one large bf16 matmul reaches here."""

from __future__ import annotations

import time

import torch


def resolve_peak_tflops(requested, device, dtype=torch.bfloat16):
    """--peak-tflops, else the trainer's datasheet peak of the device (`asyncgrpo.train.flops`); CPU
    runs (smoke tests) get a nominal 1 TFLOP/s."""
    from asyncgrpo.train.flops import peak_flops

    if requested is not None:
        return requested
    peak = peak_flops(device, dtype)
    if peak is None and device.type == "cuda":
        raise SystemExit(f"no datasheet peak for {torch.cuda.get_device_name(device)!r} in "
                         "asyncgrpo.train.flops.PEAK_TFLOPS: pass --peak-tflops")
    return peak / 1e12 if peak else 1.0


def matmul_tflops(device, size=8192, repeats=10):
    """What one size^3 bf16 matmul reaches on this GPU (TFLOP/s, after 3 warm-ups); None on CPU."""
    if device.type != "cuda":
        return None
    a, b = (torch.randn(size, size, device=device, dtype=torch.bfloat16) for _ in range(2))
    for _ in range(3):
        a @ b
    torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in range(repeats):
        a @ b
    torch.cuda.synchronize(device)
    return 2 * size**3 * repeats / (time.perf_counter() - start) / 1e12
