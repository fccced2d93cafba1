"""Assembling the engine: the one place that builds the KV cache, the scheduler, a hybrid's recurrent
state, the LoRA slots, the execution plan, the step graphs and the model runner around a loaded model.

    EngineConfig (frozen; serve.py builds it from the flags, the KV cache sized after loading)
        -> build_engine(config, served)
             PagedKVCache      kv_cache_tokens // BLOCK_SIZE blocks of every attention layer
             Scheduler         block pool (prefix caching where the model allows), sliding window
             RecurrentState    a hybrid's Gated DeltaNet layers (None otherwise)
             ServedLora        --enable-lora's slots (None otherwise)
             ExecutionPlan     probed once (`attention/plan.py`), its kernels compiled
             StepGraphs        CUDA, without --enforce-eager
             ModelRunner       checked against the model (`self_check.check_plan`: the plan, or its
                               downgrade, whose engine computes what the model computes)
        -> Engine (not started: `Engine.start` takes the HTTP side's loop)

Nothing here reads command-line arguments, and nothing changes these parts once built.
"""

from __future__ import annotations

from dataclasses import dataclass

from asyncgrpo.server.attention.base import PlanFlags
from asyncgrpo.server.attention.plan import ExecutionPlan, resolve_plan
from asyncgrpo.server.attention_math import kv_window
from asyncgrpo.server.engine import Engine
from asyncgrpo.server.kv_cache import PagedKVCache
from asyncgrpo.server.loading import ModelLoadError, ServedModel
from asyncgrpo.server.lora import ServedLora
from asyncgrpo.server.prefix_cache import BlockPool, prefix_caching_enabled
from asyncgrpo.server.recurrent_state import RecurrentState
from asyncgrpo.server.runner import ModelRunner
from asyncgrpo.server.scheduler import Scheduler
from asyncgrpo.server.self_check import check_plan
from asyncgrpo.server.step_graphs import StepGraphs

BLOCK_SIZE = 16
PROMPT_ATTENTION = ("auto", "flash_varlen", "padded")


@dataclass(frozen=True)
class EngineConfig:
    """What the engine is built from (`asyncgrpo serve`'s flags, resolved for the device and the model)."""

    name: str  # the model as it was asked for (messages name it)
    max_num_seqs: int
    max_num_batched_tokens: int
    kv_cache_tokens: int  # the KV cache's size (`loading.kv_cache_tokens`)
    admission_interval: int = 1
    enforce_eager: bool = False  # no CUDA graphs
    async_scheduling: bool = False
    # how prompt chunks attend: packed for FlashAttention where its checks pass, else padded (auto); packed
    # or refused (flash_varlen); padded (padded)
    prompt_attention: str = "auto"
    enable_prefix_caching: bool = True
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16

    def __post_init__(self) -> None:
        if self.prompt_attention not in PROMPT_ATTENTION:
            raise ValueError(f"prompt_attention must be one of {PROMPT_ATTENTION}, got "
                             f"{self.prompt_attention!r}")

    @property
    def plan_flags(self) -> PlanFlags:
        return PlanFlags(packed_prompts=False if self.prompt_attention == "padded" else None)


def build_engine(config: EngineConfig, served: ServedModel) -> Engine:
    """The engine around `served`, checked against it (a user error, or a model it would serve wrongly, is
    a `ModelLoadError`)."""
    model, device = served.model, served.device
    cache = PagedKVCache(served.num_layers, config.kv_cache_tokens // BLOCK_SIZE, BLOCK_SIZE,
                         served.num_kv_heads, served.head_dim, served.dtype, device, served.attention_layers)
    caching = prefix_caching_enabled(config.enable_prefix_caching, model.config.get_text_config())
    recurrent = RecurrentState.for_model(model, config.max_num_seqs, device)
    scheduler = Scheduler(
        BlockPool(cache.num_blocks, caching), BLOCK_SIZE, config.max_num_seqs, config.max_num_batched_tokens,
        served.max_model_len, window=kv_window(model, served.attention_layers),
        admission_interval=config.admission_interval,
    )
    lora = ServedLora(model, config.max_loras, config.max_lora_rank) if config.enable_lora else None
    plan = resolve_plan(model, cache, device, config.plan_flags)
    # flash_varlen insists on packed prompt chunks: refused where the probe did not take them, and an engine
    # that then fails the model's self-check is refused too (no downgrade)
    if config.prompt_attention == "flash_varlen" and not plan.packed_prompts:
        raise ModelLoadError(
            "--prompt-attention flash_varlen: FlashAttention's variable-length kernel does not serve this "
            "model here (it needs CUDA, fp16/bf16, no soft-capped layers, and its start-up check; device "
            f"{device}, {served.dtype}); use --prompt-attention auto or padded"
        )

    def runner_for(plan: ExecutionPlan) -> ModelRunner:
        graphs = None
        if device.type == "cuda" and not config.enforce_eager:
            graphs = StepGraphs(model, cache, plan, config.max_num_seqs, scheduler.max_blocks, True,
                                served.vocab_size, lora=lora, recurrent=recurrent)
        return ModelRunner(model, cache, plan, served.vocab_size, scheduler.block_table, graphs, recurrent,
                           lora)

    runner = check_plan(plan, runner_for, scheduler, model, vocab_size=served.vocab_size, dtype=served.dtype,
                        name=config.name, downgrade=config.prompt_attention == "auto")
    return Engine(runner, scheduler, config.async_scheduling)
