"""What the trainer takes from the server it trains against: the packing budget and the serving dtype.

Read once, on rank 0, from `ServerInfo` at connect time (then broadcast to the other ranks).
"""

from __future__ import annotations

import logging

import torch

from asyncgrpo.generation.server_info import ServerInfo
from asyncgrpo.modeling.load import TORCH_DTYPES

logger = logging.getLogger(__name__)



def dtype_name(dtype: torch.dtype | str) -> str:
    return str(dtype).replace("torch.", "")


def token_budget(requested: int | None, info: ServerInfo) -> int:
    """`token_budget`, or the server's `max_model_len` when None."""
    if requested is not None:
        return int(requested)
    if info.max_model_len is None:
        raise ValueError(
            "token_budget is None and the server did not report max_model_len: set `token_budget`")
    return int(info.max_model_len)


def serving_dtype(info: ServerInfo) -> torch.dtype:
    """The dtype weight pushes are cast to: the server's (float32 when it does not say)."""
    return TORCH_DTYPES.get(dtype_name(info.dtype), torch.float32)


def warn_server_mismatches(
    matmul_dtype: torch.dtype, max_completion_length: int | None, info: ServerInfo
) -> None:
    """What the server serves that the run's settings do not expect: each a warning with the fix.
    matmul_dtype: the precision of the trainer's matmuls (`training_dtype`), not its weights': float32
    weights under bf16 autocast multiply in bfloat16, as a bfloat16 server does."""
    warn_dtype_mismatch(matmul_dtype, info)
    warn_short_context(max_completion_length, info)


def warn_dtype_mismatch(matmul_dtype: torch.dtype, info: ServerInfo) -> None:
    if not info.dtype:
        return
    trainer, server = dtype_name(matmul_dtype), dtype_name(info.dtype)
    if server != trainer:
        logger.warning(
            "the server runs in %s and the trainer in %s: importance ratios will carry that mismatch "
            "(watch sampling/sampling_logp_difference); start the server with --dtype %s to close it",
            server, trainer, trainer,
        )


def warn_short_context(max_completion_length: int | None, info: ServerInfo) -> None:
    """A completion cannot be longer than the server's context less its prompt: say so when the config
    asks for more than the whole context (the server then cuts completions short, as finished by length)."""
    if (max_completion_length is not None and info.max_model_len is not None
            and max_completion_length >= info.max_model_len):
        logger.warning(
            "max_completion_length=%d is not below the server's max_model_len=%d: a completion ends where "
            "prompt + completion fill the context, so completions are shorter than asked (and cut, counted "
            "in completions/clipped_ratio); lower max_completion_length or start the server with a larger "
            "--max-model-len", max_completion_length, info.max_model_len,
        )


def training_dtype(*, bf16: bool, fp16: bool, weights_dtype: torch.dtype) -> torch.dtype:
    """The precision of the training matmuls: the mixed-precision dtype, else the weights'."""
    if bf16:
        return torch.bfloat16
    if fp16:
        return torch.float16
    return weights_dtype
