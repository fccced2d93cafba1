"""Checksums of weights, to check that a server holds exactly the trainer's weights after a sync.

A tensor's digest is `"<dtype>:<shape>:<sha256 of its row-major bytes>"`, so two tensors have the
same digest only if they have the same dtype, shape and bits. The embedded server answers
`GET /weight_checksum` with the digest of every parameter it serves (an extension: vLLM has no such
route); the trainer side computes the same over what it sends (`weights_checksum`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

import torch


def tensor_digest(tensor: torch.Tensor) -> str:
    """`"bfloat16:[1024, 512]:<sha256 hex>"` of the tensor's bytes (copied to the host)."""
    data = tensor.detach().contiguous().reshape(-1).view(torch.uint8).cpu().numpy()
    return (f"{str(tensor.dtype).removeprefix('torch.')}:{list(tensor.shape)}:"
            f"{hashlib.sha256(data).hexdigest()}")


def weights_checksum(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> dict[str, str]:
    """{name: `tensor_digest`} of every tensor, one at a time (a lazy iterator is never held whole)."""
    return {name: tensor_digest(tensor) for name, tensor in named_tensors}


def checksum_mismatches(expected: dict[str, str], actual: dict[str, str]) -> list[str]:
    """Names of `expected` whose digest `actual` lacks or differs on (extra names in `actual`, such as
    a tied `lm_head.weight` the sender never sends, are ignored)."""
    return [name for name, digest in expected.items() if actual.get(name) != digest]
