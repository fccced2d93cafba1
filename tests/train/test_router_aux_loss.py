"""Mixture-of-Experts models: the trainer adds `router_aux_loss_coef * aux_loss` to the policy loss, with
`aux_loss` the load-balancing loss of the model's own router logits (Switch Transformer, eqs. 4-6)."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

from asyncgrpo import AsyncGRPOConfig, AsyncGRPOTrainer
from asyncgrpo.modeling.load import load_tokenizer
from asyncgrpo.packing.tree import Sample
from asyncgrpo.train.loss import loss_metrics, policy_loss
from asyncgrpo.train.model_setup import router_aux_loss_coef
from asyncgrpo.train.rollout_batches import MicroBatchInput

pytestmark = pytest.mark.engine

os.environ.setdefault("HF_HUB_OFFLINE", "1")
TOKENIZER = "asyncgrpo/tiny-chat"
VOCAB = 491  # the bundled tokenizer's
NUM_EXPERTS, TOP_K = 4, 2


def tiny_moe(seed: int = 0, **overrides) -> torch.nn.Module:
    config = CONFIG_MAPPING["qwen3_moe"](
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, num_experts=NUM_EXPERTS, num_experts_per_tok=TOP_K,
        moe_intermediate_size=16, decoder_sparse_step=1, mlp_only_layers=[], attention_dropout=0.0,
        router_aux_loss_coef=0.01, **overrides,
    )
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32)


def plain_load_balancing_loss(router_logits: list[torch.Tensor], num_experts: int,
                              top_k: int) -> torch.Tensor:
    """num_experts * sum_e f_e * P_e over every (layer, token): f_e the share of top-k assignments that
    went to expert e (they sum to top_k), P_e its mean router probability."""
    probs = torch.cat([torch.softmax(logits.double(), dim=-1) for logits in router_logits])  # [L*T, E]
    chosen = torch.topk(probs, top_k, dim=-1).indices
    assignments = torch.nn.functional.one_hot(chosen, num_experts).sum(dim=1).double()  # [L*T, E]
    return num_experts * (assignments.mean(dim=0) * probs.mean(dim=0)).sum()


def two_samples() -> list[Sample]:
    # distinct first tokens: nothing is shared, the packed row is the two samples side by side
    rng = np.random.default_rng(0)
    samples = []
    for first, adv in ((3, 1.0), (4, -0.5)):
        tokens = [first, *rng.integers(5, VOCAB, 9).tolist()]
        mask = [False] * 5 + [True] * 5
        # sampler log-probs near a random model's (about -log V): importance ratios inside the IS mask
        sampler = (-np.log(VOCAB) + 0.1 * rng.standard_normal(5)).tolist()
        samples.append(Sample(tokens, mask, [0.0] * 5 + sampler, adv, group_id=0))
    return samples


def _trainer(tmp_path, model, **overrides) -> AsyncGRPOTrainer:
    args = AsyncGRPOConfig(
        output_dir=str(tmp_path), use_cpu=True, bf16=False, gradient_checkpointing=False, report_to="none",
        score_centering=False, temperature=1.0, **overrides,
    )
    return AsyncGRPOTrainer(model=model, reward_funcs=lambda **kw: [0.0], args=args,
                            train_dataset=[{"prompt": [{"role": "user", "content": "x"}]}],
                            processing_class=load_tokenizer(TOKENIZER))


@pytest.mark.parametrize("coef", [None, 0.5])
def test_training_step_loss_is_policy_loss_plus_coef_times_the_models_own_aux_loss(tmp_path, coef):
    model = tiny_moe()
    samples = two_samples()
    # reference, before the trainer touches the model: each sample alone, the model's own logits
    # and router logits
    logprobs, advantages, sampler, owner, router = [], [], [], [], [[], []]
    with torch.no_grad():
        for i, s in enumerate(samples):
            out = model(input_ids=torch.as_tensor(s.token_ids, dtype=torch.long)[None],
                        output_router_logits=True)
            t = torch.as_tensor(np.flatnonzero(s.trained_mask))
            lp = torch.log_softmax(out.logits[0, t - 1].double(), -1).gather(
                -1, torch.as_tensor(s.token_ids)[t, None].long())
            logprobs.append(lp[:, 0])
            sampler.append(torch.as_tensor(s.sampler_logprobs[t]))
            advantages.append(torch.full((t.numel(),), s.advantage))
            owner.append(torch.full((t.numel(),), i))
            for layer, logits in enumerate(out.router_logits):
                router[layer].append(logits)
    num_trained = sum(s.num_trained for s in samples)
    policy = policy_loss(torch.cat(logprobs), torch.cat(sampler), torch.cat(advantages), torch.cat(owner),
                         num_trained_tokens_global=num_trained,
                         gradient_accumulation_steps=1, score_centering=False)
    aux = plain_load_balancing_loss([torch.cat(layer) for layer in router], NUM_EXPERTS, TOP_K)
    weight = 0.01 if coef is None else coef  # None: the model config's router_aux_loss_coef

    trainer = _trainer(tmp_path, model, router_aux_loss_coef=coef)
    loss = trainer.training_step(trainer.model,
                                 MicroBatchInput(samples, num_trained_tokens_global=num_trained))
    assert policy.loss.abs() > 1e-3 and weight * aux > 1e-3  # both terms matter
    torch.testing.assert_close(loss.double(), policy.loss.double() + weight * aux, rtol=1e-5, atol=1e-6)
    gate = trainer.model.model.layers[0].mlp.gate.weight
    assert gate.grad is not None and gate.grad.abs().sum() > 0  # the router learns from the aux loss
    logged = loss_metrics(trainer._metrics.loss_stats)
    torch.testing.assert_close(torch.tensor(logged["aux_loss"], dtype=torch.float64),
                               aux, rtol=1e-5, atol=1e-7)


def test_zero_coefficient_adds_nothing_and_logs_no_aux_loss(tmp_path):
    model = tiny_moe()
    samples = two_samples()
    num_trained = sum(s.num_trained for s in samples)
    trainer = _trainer(tmp_path, model, router_aux_loss_coef=0.0)
    trainer.training_step(trainer.model, MicroBatchInput(samples, num_trained_tokens_global=num_trained))
    assert "aux_loss" not in loss_metrics(trainer._metrics.loss_stats)
    assert trainer.model.model.layers[0].mlp.gate.weight.grad.abs().sum() > 0  # the policy loss routes too


def test_a_coefficient_on_a_model_without_a_router_is_an_error():
    dense = CONFIG_MAPPING["qwen3"](vocab_size=VOCAB)
    with pytest.raises(ValueError, match="no router"):
        router_aux_loss_coef(dense, 0.01)
    assert router_aux_loss_coef(dense, None) == 0.0 and router_aux_loss_coef(dense, 0.0) == 0.0
    moe = tiny_moe().config
    assert router_aux_loss_coef(moe, None) == 0.01 and router_aux_loss_coef(moe, 0.2) == 0.2

