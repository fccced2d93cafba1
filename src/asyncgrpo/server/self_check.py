"""Load-time safety net: the engine must compute what the model itself computes.

A short prompt goes through the engine (one prefill step, then decode steps through the paged KV
cache, CUDA graphs included where they are on), sampling with temperature 1 and no truncation, so
the engine's log-probs are the plain log-softmax of its logits. The same tokens then go through the
model's own forward (its attention implementation, its masks: sliding windows, soft-capping, ...)
in one pass. If the log-probs of the sampled tokens and of the top-K tokens disagree beyond the
dtype's tolerance, the engine serves this model wrongly (it would sample from a distribution the
trainer does not know, silently biasing every importance ratio) and the model is refused.

`check_plan` runs it on the engine under its execution plan (`attention/plan.py`). A plan whose fast
paths passed their own checks may still not serve the whole model right: then its `downgraded()` plan
(packed prompt chunks padded instead) is checked and served, where the start-up left that choice to the
probe; the plan is never changed afterwards.

It costs one prompt of PROMPT_LEN tokens and NUM_DECODE decode steps: milliseconds on the tiny model.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from asyncgrpo.server.attention.plan import ExecutionPlan
from asyncgrpo.server.loading import ModelLoadError
from asyncgrpo.server.runner import ModelRunner
from asyncgrpo.server.scheduler import Scheduler
from asyncgrpo.server.sequence import SeqParams, Sequence

logger = logging.getLogger(__name__)

PROMPT_LEN = 12
NUM_DECODE = 8  # also long enough to cross a block boundary of the paged cache (16 tokens)
TOP_K = 5
# max |engine - model| over the compared log-probs. Both sides run the same weights in the same dtype;
# what differs is the kernels (paged decode attention vs the model's attention, fused blocks), whose
# rounding grows as the mantissa shrinks
TOLERANCE = {torch.float32: 2e-3, torch.float16: 0.05, torch.bfloat16: 0.25}
# the model's attention: SDPA (what the fused blocks of fused_layers.py were checked against), else the
# model's eager attention for the options SDPA refuses (soft-capping)
REFERENCE_ATTENTIONS = ("sdpa", "eager")


class SelfCheckError(ModelLoadError):
    """The engine's log-probs differ from the model's own forward: the model is refused."""


@dataclass(frozen=True)
class SelfCheckResult:
    max_abs_diff: float
    tolerance: float
    num_compared: int


def _prompt(vocab_size: int) -> list[int]:
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, vocab_size, (PROMPT_LEN,), generator=g).tolist()


def _engine_run(runner: ModelRunner, scheduler: Scheduler, prompt: list[int]) -> Sequence:
    params = SeqParams(
        temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=0, max_tokens=NUM_DECODE + 1, min_tokens=0,
        stop_token_ids=frozenset(), eos_token_id=None, extra_eos_ids=frozenset(), logprobs=TOP_K,
        want_mask=False,
    )
    seq = Sequence(-2, "self-check", 0, prompt, params, max_model_len=1 << 30)
    scheduler.add(seq)
    try:
        while not seq.finished:
            plan = scheduler.schedule()
            runner.step(plan.decode, plan.prefill).record([seq], "self-check")
    finally:
        scheduler.remove(seq)
    return seq


@torch.inference_mode()
def _model_logprobs(model: torch.nn.Module, tokens: list[int], device: torch.device) -> torch.Tensor:
    """log-softmax [len(tokens), V] of the model's own forward (its own attention implementation)."""
    engine_attention = model.config._attn_implementation
    ids = torch.tensor([tokens], device=device)
    try:
        for i, attention in enumerate(REFERENCE_ATTENTIONS):
            try:
                model.set_attn_implementation(attention)
                logits = model(input_ids=ids, use_cache=False).logits[0]
                break
            except (ValueError, KeyError):  # this implementation cannot run one of the model's options
                if i == len(REFERENCE_ATTENTIONS) - 1:
                    raise
    finally:
        model.set_attn_implementation(engine_attention)
    return torch.log_softmax(logits.float(), dim=-1)


def check_engine(
    runner: ModelRunner, scheduler: Scheduler, model: torch.nn.Module, *, vocab_size: int, dtype: torch.dtype,
    device: torch.device, name: str,
) -> SelfCheckResult:
    """Compare the engine with the model's forward; raise SelfCheckError naming the gap if it is too wide."""
    prompt = _prompt(vocab_size)
    seq = _engine_run(runner, scheduler, prompt)
    ref = _model_logprobs(model, prompt + seq.output, device).cpu()
    rows = ref[len(prompt) - 1 : len(prompt) - 1 + len(seq.output)]  # the row that predicts output token i
    engine, model_side = [], []
    for i, token in enumerate(seq.output):
        top_ids, top_logprobs = seq.top(i)
        engine += [seq.logprobs[i], *top_logprobs]
        model_side += [rows[i, token].item(), *rows[i, top_ids].tolist()]
    diff = (torch.tensor(engine) - torch.tensor(model_side)).abs()
    worst = float(diff.max()) if torch.isfinite(diff).all() else float("inf")
    tolerance = TOLERANCE.get(dtype, TOLERANCE[torch.bfloat16])
    result = SelfCheckResult(worst, tolerance, len(engine))
    if not worst <= tolerance:
        step = int(diff.argmax()) // (TOP_K + 1)
        where = "the prefill" if step == 0 else f"decode step {step}"
        raise SelfCheckError(
            f"{name}: the embedded server's engine does not compute what the model computes: over a "
            f"{PROMPT_LEN}-token prompt and {len(seq.output) - 1} decode steps its log-probs differ from the "
            f"model's own forward by up to {worst:.3g} (worst at {where}; {dtype} allows {tolerance:g}). "
            "Serving it would sample from a distribution the trainer does not know. This model's "
            "architecture (or one of its settings, e.g. sliding-window attention or attention soft-capping) "
            "is not supported by the embedded server: serve it with vLLM"
        )
    logger.info("self-check passed: engine and model log-probs agree within %.2g (%s allows %g, %d compared)",
                worst, dtype, tolerance, len(engine))
    return result


def check_plan(
    plan: ExecutionPlan, runner_for: Callable[[ExecutionPlan], ModelRunner], scheduler: Scheduler,
    model: torch.nn.Module, *, vocab_size: int, dtype: torch.dtype, name: str, downgrade: bool,
) -> ModelRunner:
    """The runner (`runner_for(plan)`) of the first plan whose engine computes what the model computes:
    `plan`, else, with `downgrade`, its downgraded plan. Raises SelfCheckError when none does."""
    runner = runner_for(plan)
    try:
        check_engine(runner, scheduler, model, vocab_size=vocab_size, dtype=dtype, device=plan.device,
                     name=name)
        return runner
    except SelfCheckError as exc:
        lower = plan.downgraded() if downgrade else None
        if lower is None:
            raise
        # the packed prompt attention passed its own check but not the whole model's: serve what is known to
        # be right (the check's cached prompt block was computed the packed way: forget it)
        logger.warning("%s\nwith prompt chunks packed for FlashAttention; serving with padded prompt chunks "
                       "instead (what --prompt-attention padded asks for)", exc)
        scheduler.invalidate_prefix_cache()
    logger.info("execution plan: %s", lower.describe())
    runner = runner_for(lower)
    check_engine(runner, scheduler, model, vocab_size=vocab_size, dtype=dtype, device=lower.device, name=name)
    return runner
