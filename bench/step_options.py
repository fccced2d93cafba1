"""The training-step variants that bench/packing.py and bench/profile_step.py compare side by side.

A variant is a '+'-joined list of options; `base` (none) is the trainer's default path:

    compile   each decoder layer compiled in place (asyncgrpo.train.compiled_layers), dynamic row length
    head      the fused log-prob head (token_logprobs(fused=True): its elementwise work compiled)
    nockpt    no activation checkpointing (the trainer's gradient_checkpointing=False): nothing recomputed
    sac       selective recomputation instead of whole-layer checkpointing: no checkpointing, and the
              compiled layers' forward/backward partitioner keeps at most SAC_BUDGET (or the run's
              --sac-budget; the trainer's activation_memory_budget) of the activation
              memory that saving everything would take, recomputing the cheapest ops first (torch's
              `torch._functorch.config.activation_memory_budget`; needs `compile`)
    tune      the layers compiled with mode "max-autotune-no-cudagraphs": inductor times FlexAttention's
              block sizes and its own matmul templates against cuBLAS at the first compile (minutes of
              warm-up; needs `compile`)
    flash     FlexAttention's FlashAttention-4 backend (kernel_options BACKEND="FLASH": CuTe DSL kernels of
              the flash-attn-4 package, optional) instead of its Triton kernels (needs `compile`); the
              rows' masks carry these options (TreeMask.kernel_options) and read tensors padded to the
              token budget (TreeMask.mask_capacity), since the backend refuses a mask that captures a
              symbolic size
    liger     liger-kernel's RMSNorm / SwiGLU / rotary Triton kernels (Qwen3 shapes; optional package, CUDA)

`compile+head` is what the trainer runs with torch_compile=True; `compile+head+nockpt` adds
gradient_checkpointing=False. Each variant gets its own copy of the model (same weights), so one
variant's patches never reach another's timing; run a variant's steps inside `variant_scope`.
"""

from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass

OPTIONS = ("compile", "head", "nockpt", "sac", "tune", "flash", "liger")
SAC_BUDGET = 0.5


@dataclass(frozen=True)
class StepOptions:
    compile: bool = False
    head: bool = False
    nockpt: bool = False
    sac: bool = False
    tune: bool = False
    flash: bool = False
    liger: bool = False

    @classmethod
    def parse(cls, text: str) -> StepOptions:
        parts = [p for p in text.split("+") if p and p != "base"]
        unknown = sorted(set(parts) - set(OPTIONS))
        if unknown:
            raise ValueError(f"variant {text!r}: unknown option(s) {unknown}; combine 'base' or {OPTIONS} "
                             "with '+'")
        if "sac" in parts and ("compile" not in parts or "nockpt" in parts):
            raise ValueError(f"variant {text!r}: 'sac' is the compiled layers' own recomputation: it needs "
                             "'compile' and replaces checkpointing ('nockpt' says there is none)")
        for option in ("tune", "flash"):
            if option in parts and "compile" not in parts:
                raise ValueError(f"variant {text!r}: '{option}' is an option of the compiled layers: it "
                                 "needs 'compile'")
        return cls(**{p: True for p in parts})

    @property
    def name(self) -> str:
        return "+".join(p for p in OPTIONS if getattr(self, p)) or "base"


def prepare_model(base_model, options: StepOptions, *, recompute_context=None):
    """A copy of `base_model` (tree attention enabled, train mode) set up for `options`.
    `recompute_context`: a callable returning the context manager that activation checkpointing's
    recomputation runs under (the profiler's marker), or None."""
    model = copy.deepcopy(base_model) if options != StepOptions() else base_model
    model.config.use_cache = False
    if not (options.nockpt or options.sac):
        kwargs = {"use_reentrant": False}
        if recompute_context is not None:
            kwargs["context_fn"] = lambda: (contextlib.nullcontext(), recompute_context())
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_disable()
    if options.liger:
        apply_liger(model)
    if options.compile:
        from asyncgrpo.train.compiled_layers import compile_decoder_layers

        compile_decoder_layers(model, mode="max-autotune-no-cudagraphs" if options.tune else None)
    return model


@contextlib.contextmanager
def variant_scope(options: StepOptions, sac_budget: float = SAC_BUDGET):
    """Around a variant's steps: what it changes for the whole process (liger's rotary function, the
    partitioner's memory budget, `sac_budget` for `sac`) holds for its runs only."""
    with contextlib.ExitStack() as stack:
        if options.liger:
            stack.enter_context(liger_rotary_scope())
        if options.sac:
            import torch._functorch.config

            stack.enter_context(compiled_afresh(torch._functorch.config.patch(activation_memory_budget=sac_budget)))
        if options.flash:  # its rows' masks carry the options (`flex_kernel_options`): only fresh graphs here
            stack.enter_context(compiled_afresh(contextlib.nullcontext()))
        yield


def flex_kernel_options(options: StepOptions) -> dict | None:
    """The FlexAttention kernel_options a variant's rows' masks carry (TreeMask.kernel_options): for
    `flash` the trainer's flex_attention_backend="flash", checked as the trainer checks it."""
    if not options.flash:
        return None
    from asyncgrpo.train.compiled_layers import flex_backend_options

    try:
        return flex_backend_options("flash", "cuda")
    except (ImportError, ValueError) as exc:
        raise SystemExit(f"the 'flash' variant: {exc} (or leave 'flash' out of --variants)") from None


@contextlib.contextmanager
def compiled_afresh(setting):
    """`setting` (a context manager) in force for the layers compiled inside: dynamo's caches are
    cleared on entry and exit, so that neither this variant nor the next reuses a graph compiled under
    another setting (the partitioner's budget is read at compile time)."""
    import torch

    torch._dynamo.reset()
    try:
        with setting:
            yield
    finally:
        torch._dynamo.reset()


@contextlib.contextmanager
def liger_rotary_scope():
    """liger-kernel swaps Qwen3's rotary function module-wide: keep the swap to this variant's runs."""
    from liger_kernel.transformers.rope import liger_rotary_pos_emb
    from transformers.models.qwen3 import modeling_qwen3

    original = modeling_qwen3.apply_rotary_pos_emb
    modeling_qwen3.apply_rotary_pos_emb = liger_rotary_pos_emb
    try:
        yield
    finally:
        modeling_qwen3.apply_rotary_pos_emb = original


def apply_liger(model) -> None:
    """liger-kernel's RMSNorm and SwiGLU on this model's modules (its rotary: `liger_rotary_scope`)."""
    try:
        from liger_kernel.transformers import apply_liger_kernel_to_qwen3
        from transformers.models.qwen3 import modeling_qwen3
    except ImportError as exc:
        raise SystemExit(f"the 'liger' variant needs the liger-kernel package ({exc}); install it (pip "
                         "install liger-kernel) or leave 'liger' out of --variants") from None
    if model.config.model_type != "qwen3":
        raise SystemExit(f"the 'liger' variant patches Qwen3 models only, not {model.config.model_type!r}")
    rotary, norm_cls, mlp_cls = (modeling_qwen3.apply_rotary_pos_emb, modeling_qwen3.Qwen3RMSNorm,
                                 modeling_qwen3.Qwen3MLP)
    apply_liger_kernel_to_qwen3(rope=False, rms_norm=True, swiglu=True, cross_entropy=False,
                                fused_linear_cross_entropy=False, model=model)
    # the instance is patched; new Qwen3 models of other variants keep the transformers classes
    modeling_qwen3.apply_rotary_pos_emb, modeling_qwen3.Qwen3RMSNorm, modeling_qwen3.Qwen3MLP = (
        rotary, norm_cls, mlp_cls)
