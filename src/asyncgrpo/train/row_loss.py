"""One packed row -> its loss: the model's forward, the log-probs, the policy loss (and MoE aux loss).

    row (PackedRow) --hidden_states_and_head--> hidden [T, H], lm_head
        --token_logprobs--> target log-probs [N] (+ top-K [N, K], entropy), temperature and candidate sets
        --policy_loss-----> loss normalised by the trained tokens of every process's row
        --add_router_aux_loss (MoE with router_aux_loss_coef > 0)

The caller opens the tree-attention context and runs backward; the settings are read from the config
once (`LossSettings.from_config`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from asyncgrpo.config import AsyncGRPOConfig
from asyncgrpo.packing.tree import PackedRow
from asyncgrpo.train.logprobs import token_logprobs
from asyncgrpo.train.loss import PolicyLoss, add_router_aux_loss, policy_loss
from asyncgrpo.train.model_setup import hidden_states_and_head


@dataclass(frozen=True)
class LossSettings:
    """The config values the loss of a row uses, plus the model's logit processing."""

    temperature: float
    score_centering: bool
    gradient_accumulation_steps: int
    epsilon: float
    epsilon_high: float | None
    is_clip_min: float
    is_clip_max: float
    router_aux_loss_coef: float
    num_processes: int
    logit_scale: float
    logit_softcapping: float | None
    # with the compiled layers: the head's elementwise work compiled (train/logprob_epilogue.py)
    fused_logprob_head: bool = False

    @classmethod
    def from_config(
        cls, args: AsyncGRPOConfig, *, logit_processing: dict[str, float | None], router_aux_loss_coef: float,
        num_processes: int, fused_logprob_head: bool = False,
    ) -> LossSettings:
        return cls(
            temperature=args.temperature,
            score_centering=args.score_centering,
            gradient_accumulation_steps=args.gradient_accumulation_steps,
            epsilon=args.epsilon,
            epsilon_high=args.epsilon_high,
            is_clip_min=args.vllm_importance_sampling_clip_min,
            is_clip_max=args.vllm_importance_sampling_clip_max,
            router_aux_loss_coef=router_aux_loss_coef,
            num_processes=num_processes,
            logit_scale=logit_processing["logit_scale"],
            logit_softcapping=logit_processing["logit_softcapping"],
            fused_logprob_head=fused_logprob_head,
        )


def row_loss(
    model: torch.nn.Module, row: PackedRow, *, num_trained_tokens_global: int, settings: LossSettings
) -> PolicyLoss:
    """The loss of this process's `row` (already on the model's device), inside the tree-attention context."""
    s = settings
    hidden, head, aux_loss = hidden_states_and_head(
        model, row.input_ids, row.position_ids, router_aux_loss=s.router_aux_loss_coef > 0
    )
    logps = token_logprobs(
        hidden,
        head.weight,
        row.pred_index,
        row.target_ids,
        temperature=s.temperature,
        lm_head_bias=getattr(head, "bias", None),  # a Linear without bias, or a tied embedding
        logit_scale=s.logit_scale,
        logit_softcapping=s.logit_softcapping,
        topk_ids=row.sampler_topk_ids if s.score_centering else None,
        candidate_ids=row.candidate_ids,
        candidate_offsets=row.candidate_offsets,
        fused=s.fused_logprob_head,
    )
    result = policy_loss(
        logps.target_logprobs,
        row.sampler_logprobs,
        row.advantages,
        row.completion_index,
        num_trained_tokens_global=num_trained_tokens_global,
        gradient_accumulation_steps=s.gradient_accumulation_steps,
        score_centering=s.score_centering,
        topk_logprobs=logps.topk_logprobs,
        sampler_topk_logprobs=row.sampler_topk_logprobs if s.score_centering else None,
        entropy=logps.entropy,
        epsilon=s.epsilon,
        epsilon_high=s.epsilon_high,
        is_clip_min=s.is_clip_min,
        is_clip_max=s.is_clip_max,
    )
    if aux_loss is not None:
        result = add_router_aux_loss(
            result, aux_loss, coef=s.router_aux_loss_coef,
            gradient_accumulation_steps=s.gradient_accumulation_steps, num_processes=s.num_processes,
        )
    return result
