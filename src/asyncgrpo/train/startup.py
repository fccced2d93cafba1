"""What `AsyncGRPOTrainer.__init__` makes of the model and tokenizer it is given (every rank, once).

    model id or PreTrainedModel --prepare_policy--> checked for tree packing, tree attention on,
                                                    of a vision-language model only the text model trains
        read from it before PEFT: FLOP model, MoE aux-loss weight, logit processing
        --wrap_peft (peft_config)--> --choose_fast_paths (torch_compile, flex_attention_backend)--> the model
                                     to train: layers compiled where asked or where "auto" probes them
    processing_class, or the model's own tokenizer --prepare_chat_template--> the tokenizer

`prepare_policy_and_tokenizer` runs before the Trainer is built; `fit_accelerator` right after, once the
Trainer's accelerator exists. The arguments themselves are checked in `asyncgrpo.train.inputs`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from asyncgrpo.config import AsyncGRPOConfig
from asyncgrpo.data.chat_templates import prepare_chat_template
from asyncgrpo.train.fast_paths import FastPaths, check_explicit_backend, choose_fast_paths
from asyncgrpo.train.flops import FlopModel
from asyncgrpo.train.inputs import check_fsdp_version
from asyncgrpo.train.model_setup import (
    load_tokenizer,
    logit_processing,
    prepare_policy,
    router_aux_loss_coef,
    wrap_peft,
)

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PreparedPolicy:
    """The model and tokenizer to hand to the Trainer, and what the loss and perf/*_mfu read of the model."""

    model: torch.nn.Module  # PEFT-wrapped, its layers compiled where fast_paths says so
    model_id: str
    tokenizer: PreTrainedTokenizerBase
    flop_model: FlopModel | None  # of the base model: adapters are not the model's FLOPs
    fast_paths: FastPaths  # compiled layers and fused head, the tree attention's kernels
    router_aux_loss_coef: float
    logit_processing: dict[str, float | None]


def prepare_policy_and_tokenizer(
    model: str | PreTrainedModel,
    args: AsyncGRPOConfig,
    *,
    processing_class: PreTrainedTokenizerBase | None,
    peft_config: Any,
    tools_enabled: bool,
    fsdp: bool,
) -> PreparedPolicy:
    """The policy loaded (or taken) and prepared, and its tokenizer (loaded from the model when None).
    `fsdp`: the model is sharded later (no fast-path probe on the whole model)."""
    check_explicit_backend(args)  # before loading anything
    model, model_id = prepare_policy(model, args)
    aux_loss_coef = router_aux_loss_coef(model.config, args.router_aux_loss_coef)
    flop_model = FlopModel.for_model(model)  # before PEFT: adapters are not the model's FLOPs
    logit_proc = logit_processing(model.config)

    if processing_class is None:
        revision = (args.model_init_kwargs or {}).get("revision")
        processing_class = load_tokenizer(model_id, trust_remote_code=args.trust_remote_code,
                                          revision=revision)

    # the tool loop renders the growing conversation each turn: its template must keep earlier
    # turns unchanged (known families are switched to a bundled training template)
    prepare_chat_template(
        processing_class,
        tools_enabled=tools_enabled,
        chat_template_kwargs=args.chat_template_kwargs,
    )
    if peft_config is not None:
        model = wrap_peft(model, peft_config)
    # each decoder layer, not the whole model (train/compiled_layers.py)
    fast_paths = choose_fast_paths(model, args, fsdp=fsdp)
    logger.info("trainer: %s", fast_paths.describe())
    return PreparedPolicy(model, model_id, processing_class, flop_model, fast_paths, aux_loss_coef,
                          logit_proc)


def fit_accelerator(accelerator: Any, args: AsyncGRPOConfig, *, is_fsdp_enabled: bool) -> None:
    """Once the Trainer built its accelerator: no second compile of the whole model, FSDP2 only, and a
    warning when `fsdp` has no effect."""
    if args.torch_compile is not False:  # compiled per layer here, or not at all: never the whole model
        from accelerate.utils import DynamoBackend

        accelerator.state.dynamo_plugin.backend = DynamoBackend.NO
    check_fsdp_version(getattr(accelerator.state, "fsdp_plugin", None))  # absent without FSDP
    if args.fsdp and not is_fsdp_enabled:
        logger.warning(
            "fsdp=%r has no effect on %s: accelerate shards only on accelerators, so every process holds "
            "the whole model (data parallel)", args.fsdp, args.device,
        )
