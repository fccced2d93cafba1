"""Non-finite losses and gradients never reach the optimizer or the inference server.

    training_step: loss --add_loss--> a "some micro-batch loss was inf/NaN" flag (no device sync)
    after clipping: grad_norm + flag --step_is_finite--> one all-reduced verdict for every process
        finite:     the optimizer steps, weights are pushed as usual
        non-finite: gradients dropped (the optimizer step is a no-op), no weight push, a warning,
                    `optimizer/nonfinite_step_count`; `MAX_CONSECUTIVE_NONFINITE_STEPS` in a row raise

The total gradient norm is the one the Trainer computes for clipping (over every process, sharded
or not), so a single inf/NaN gradient anywhere makes it non-finite. Every process takes the same
decision (the flag is all-reduced), so data-parallel replicas and shards never diverge.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import torch
import torch.distributed as dist

from asyncgrpo.train.distributed import rank_and_world_size

logger = logging.getLogger(__name__)

MAX_CONSECUTIVE_NONFINITE_STEPS = 10


class NonFiniteStepError(RuntimeError):
    """Too many optimizer steps in a row had a non-finite loss or gradient."""


class NonFiniteGuard:
    """Decides, once per optimizer step, whether its loss and gradients are finite (see module doc)."""

    def __init__(self, max_consecutive: int = MAX_CONSECUTIVE_NONFINITE_STEPS) -> None:
        self.max_consecutive = max_consecutive
        self.consecutive = 0
        self.total_skipped = 0
        self._loss_bad: torch.Tensor | None = None  # OR over the step's micro-batches, on the loss's device

    def add_loss(self, loss: torch.Tensor) -> None:
        """Note one micro-batch's loss; stays on the device (checked once per step)."""
        bad = ~torch.isfinite(loss.detach()).all()
        self._loss_bad = bad if self._loss_bad is None else (self._loss_bad | bad)

    def step_is_finite(self, grad_norm: Any, *, step: int) -> bool:
        """Whether the optimizer may take step `step` (1-based); False after logging a warning.

        Raises `NonFiniteStepError` on the `max_consecutive`-th non-finite step in a row.
        """
        if hasattr(grad_norm, "full_tensor"):  # a DTensor norm (FSDP2): its global value
            grad_norm = grad_norm.full_tensor()
        norm = torch.as_tensor(grad_norm if grad_norm is not None else 0.0).detach().float()
        device = self._loss_bad.device if self._loss_bad is not None else norm.device
        bad = (~torch.isfinite(norm.to(device))).to(torch.int32)
        if self._loss_bad is not None:
            bad = bad | self._loss_bad.to(torch.int32)
        self._loss_bad = None
        if rank_and_world_size()[1] > 1:  # one process's inf loss skips the step everywhere
            dist.all_reduce(bad, op=dist.ReduceOp.MAX)
        if not bool(bad.item()):
            self.consecutive = 0
            return True
        self.consecutive += 1
        self.total_skipped += 1
        norm_value = float(norm.item()) if norm.numel() == 1 else math.nan
        if self.consecutive >= self.max_consecutive:
            raise NonFiniteStepError(
                f"{self.consecutive} optimizer steps in a row (the last one step {step}) had a non-finite "
                f"loss or gradient (grad_norm {norm_value}); each was skipped and no weights were pushed, so "
                "the model is still the one of the last finite step. Usual causes: a learning rate too high, "
                "fp16 overflow (use bf16 or float32), or extreme advantages from a custom "
                "compute_advantages; resume from the last checkpoint after fixing it"
            )
        logger.warning(
            "step %d: non-finite loss or gradient (grad_norm %s): skipped the optimizer step and the weight "
            "push (%d in a row; training stops after %d; counted in optimizer/nonfinite_step_count)",
            step, norm_value, self.consecutive, self.max_consecutive,
        )
        return False


def drop_gradients(model: torch.nn.Module) -> None:
    """Set every gradient to None: optimizers skip parameters without a gradient, so the coming
    `optimizer.step()` changes neither the weights nor the optimizer state."""
    for param in model.parameters():
        param.grad = None
