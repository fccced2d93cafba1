"""Vision-language checkpoints (tiny random Qwen3.5 and Qwen3-VL saved to disk): loaded whole, the
text model trains (tree-packed), everything else stays frozen and out of the weight sync."""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest
import torch
from datasets import Dataset
from safetensors import safe_open

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from transformers import AutoModelForImageTextToText
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

from asyncgrpo import AsyncGRPOConfig, AsyncGRPOTrainer
from asyncgrpo.modeling.load import BUNDLED_MODELS
from asyncgrpo.packing import Sample
from asyncgrpo.rewards import accuracy_reward
from asyncgrpo.tasks import arithmetic
from asyncgrpo.train.rollout_batches import MicroBatchInput
from asyncgrpo.train.weights.gather import server_weight_metas, weights_for_server

pytestmark = pytest.mark.engine

TINY_CHAT = BUNDLED_MODELS["asyncgrpo/tiny-chat"]
_TEXT = {"vocab_size": 491, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "max_position_embeddings": 512,
         "eos_token_id": 484, "pad_token_id": 482, "tie_word_embeddings": False}
_HYBRID = {"linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 8,
           "linear_value_head_dim": 8, "layer_types": ["linear_attention", "full_attention"]}
_VISION = {"depth": 1, "hidden_size": 16, "intermediate_size": 32, "num_heads": 2, "out_hidden_size": 32,
           "patch_size": 4, "spatial_merge_size": 2, "temporal_patch_size": 2, "num_position_embeddings": 16}


def save_checkpoint(folder, model_type: str) -> str:
    """A tiny random checkpoint of `model_type` with the bundled tiny model's tokenizer."""
    text, vision = dict(_TEXT), dict(_VISION)
    if model_type == "qwen3_5":
        text.update(_HYBRID)
    else:
        text["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [1, 1, 2],
                                   "mrope_interleaved": True}
        vision["deepstack_visual_indexes"] = [0]
    config = CONFIG_MAPPING[model_type](text_config=text, vision_config=vision, tie_word_embeddings=False)
    torch.manual_seed(0)
    AutoModelForImageTextToText.from_config(config).save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(os.path.join(TINY_CHAT, name), folder)
    return str(folder)


def saved_names(folder: str) -> list[str]:
    with safe_open(os.path.join(folder, "model.safetensors"), "pt") as f:
        return list(f.keys())


def make_trainer(path: str, tmp_path) -> AsyncGRPOTrainer:
    args = AsyncGRPOConfig(
        output_dir=str(tmp_path / "out"),
        use_cpu=True,
        bf16=False,
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
        learning_rate=1e-3,
        gradient_checkpointing=False,
        num_generations=2,
        score_centering=False,
    )
    return AsyncGRPOTrainer(model=path, reward_funcs=accuracy_reward, args=args,
                            train_dataset=Dataset.from_list(arithmetic.make_dataset(4, seed=0)))


def grpo_samples(rng: np.random.Generator) -> list[Sample]:
    prompt = [int(t) for t in rng.integers(0, 480, 12)]
    samples = []
    for i in range(4):
        completion = [int(t) for t in rng.integers(0, 480, 70 if i == 0 else 5 + i)]
        mask = [False] * len(prompt) + [True] * len(completion)
        # a random model is near uniform: sampler log-probs of log(1/491) keep the importance ratios in bounds
        samples.append(
            Sample(prompt + completion, mask, [-6.2 if m else 0.0 for m in mask], float(i) - 1.5, 0)
        )
    return samples


@pytest.mark.parametrize("model_type", ["qwen3_5", "qwen3_vl"])
def test_a_vision_language_checkpoint_trains_and_syncs_its_text_model_only(model_type, tmp_path):
    path = save_checkpoint(tmp_path / model_type, model_type)
    trainer = make_trainer(path, tmp_path)
    model = trainer.model
    assert type(model) is AutoModelForImageTextToText._model_mapping[type(model.config)]
    text = {n for n, _ in model.named_parameters() if n.startswith(("model.language_model.", "lm_head."))}
    others = {n for n, _ in model.named_parameters()} - text
    assert others and all(n.startswith("model.visual.") for n in others)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == text

    # the optimizer holds the text model's parameters only (so no state for the vision tower)
    optimizer = trainer.create_optimizer()
    in_optimizer = {id(p) for group in optimizer.param_groups for p in group["params"]}
    assert in_optimizer == {id(p) for n, p in model.named_parameters() if n in text}

    # the weight sync sends the text model under the checkpoint's own names (what vLLM's loader maps)
    metas = server_weight_metas(model, torch.float32)
    text_in_file = [n for n in saved_names(path) if not n.startswith("model.visual.")]
    assert sorted(m.name for m in metas) == sorted(text_in_file)
    sent = dict(weights_for_server(model, torch.float32))
    assert list(sent) == [m.name for m in metas]
    torch.testing.assert_close(sent["lm_head.weight"], model.lm_head.weight.detach())

    # a packed training step: finite loss, gradients on the text model only
    samples = grpo_samples(np.random.default_rng(0))
    inputs = MicroBatchInput(samples=samples, num_trained_tokens_global=sum(s.num_trained for s in samples))
    visual_before = {n: p.detach().clone() for n, p in model.named_parameters() if n in others}
    loss = trainer.training_step(model, inputs)
    assert torch.isfinite(loss)
    grads = {n for n, p in model.named_parameters() if p.grad is not None and p.grad.abs().sum() > 0}
    assert grads and grads <= text
    assert any(".layers.0." in n for n in grads)
    optimizer.step()
    for name, before in visual_before.items():
        torch.testing.assert_close(dict(model.named_parameters())[name].detach(), before, atol=0, rtol=0)


def test_image_prompts_are_refused_at_construction(tmp_path):
    path = save_checkpoint(tmp_path / "qwen3_5", "qwen3_5")
    prompt = [
        {"role": "user", "content": [{"type": "image", "image": "cat.png"}, {"type": "text", "text": "Cat?"}]}
    ]
    with pytest.raises(ValueError, match="images are not supported yet"):
        AsyncGRPOTrainer(
            model=path,
            reward_funcs=accuracy_reward,
            args=AsyncGRPOConfig(output_dir=str(tmp_path / "out"), use_cpu=True, report_to="none"),
            train_dataset=Dataset.from_list([{"prompt": prompt, "answer": "yes"}]),
        )
