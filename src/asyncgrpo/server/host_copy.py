"""Host arrays to the device without waiting for it.

A copy from pageable host memory may make the host wait for the device's queued work before it
starts (the driver stages it), which would undo the engine's overlap of host and device work
(engine.py). On CUDA every step input goes through page-locked memory (PyTorch's caching host
allocator, which reuses a buffer only once its copy ran), and the copy is queued on the stream.
"""

from __future__ import annotations

import numpy as np
import torch


def _staged(array: np.ndarray | torch.Tensor, device: torch.device) -> torch.Tensor:
    host = array if isinstance(array, torch.Tensor) else torch.from_numpy(np.ascontiguousarray(array))
    if device.type == "cuda" and not host.is_pinned():
        host = host.pin_memory()
    return host


def to_device(array: np.ndarray | torch.Tensor, device: torch.device) -> torch.Tensor:
    """`array` (a numpy array or a CPU tensor) as a new tensor on `device`."""
    return _staged(array, device).to(device, non_blocking=True)


def copy_into(dst: torch.Tensor, array: np.ndarray | torch.Tensor) -> None:
    """Write `array` into the device tensor `dst` (a static buffer of a CUDA graph)."""
    dst.copy_(_staged(array, dst.device), non_blocking=True)
