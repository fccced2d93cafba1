"""The policy model: loading, its parts the loss needs, and the weights the server receives.

The loss never asks the model for logits: `decoder_and_head` returns the transformer body (hidden
states for the packed row) and the LM head's weight, and `asyncgrpo.train.logprobs` computes
log-probs only at trained positions, chunk by chunk.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from asyncgrpo.models import resolve_model_path

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "auto": "auto"}


def load_policy(model_id: str, *, dtype: str, init_kwargs: dict | None, trust_remote_code: bool) -> PreTrainedModel:
    """Load a causal LM from an id or path (bundled ids such as `asyncgrpo/tiny-chat` included)."""
    kwargs = dict(init_kwargs or {})
    kwargs.setdefault("dtype", _DTYPES.get(kwargs.pop("torch_dtype", None) or dtype, dtype))
    kwargs.setdefault("trust_remote_code", trust_remote_code)
    return AutoModelForCausalLM.from_pretrained(resolve_model_path(model_id), **kwargs)


def load_tokenizer(model_id: str, *, trust_remote_code: bool, revision: str | None = None) -> PreTrainedTokenizerBase:
    kwargs: dict[str, Any] = {"trust_remote_code": trust_remote_code}
    if revision is not None:
        kwargs["revision"] = revision
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(model_id), **kwargs)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    return tokenizer


def eos_token_ids(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """Every id that ends a turn: the generation config's eos ids plus the tokenizer's."""
    ids: list[int] = []
    gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    for value in (gen_eos, tokenizer.eos_token_id):
        if value is None:
            continue
        for v in value if isinstance(value, (list, tuple)) else [value]:
            if int(v) not in ids:
                ids.append(int(v))
    return ids


def unwrap(model: torch.nn.Module) -> PreTrainedModel:
    """The underlying transformers model (through PEFT, torch.compile and accelerate wrappers)."""
    m = model
    while True:
        if hasattr(m, "get_base_model") and callable(m.get_base_model):  # PEFT
            m = m.get_base_model()
        elif hasattr(m, "_orig_mod"):  # torch.compile
            m = m._orig_mod
        elif hasattr(m, "module") and isinstance(m.module, torch.nn.Module) and not isinstance(m, PreTrainedModel):
            m = m.module  # DDP
        else:
            return m


def decoder_and_head(model: torch.nn.Module) -> tuple[torch.nn.Module, torch.nn.Linear]:
    """(transformer body returning hidden states, LM head) of a causal LM."""
    base = unwrap(model)
    head = base.get_output_embeddings()
    body = base.get_decoder() if hasattr(base, "get_decoder") else getattr(base, base.base_model_prefix)
    if head is None or body is None:
        raise ValueError(f"{type(base).__name__} has no separable decoder and LM head; it cannot be trained here")
    return body, head


def weights_for_server(model: torch.nn.Module, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    """(checkpoint name, tensor in the serving dtype) for every weight the server must hold.

    Names are Hugging Face checkpoint names (`model.layers.0.self_attn.q_proj.weight`). A PEFT model
    is sent merged: LoRA deltas are folded into the base weights for the copy only, the trained
    model keeps its adapter.
    """
    base = unwrap(model)
    is_peft = base is not model and hasattr(model, "merge_adapter")
    if is_peft:
        model.merge_adapter()
    try:
        with torch.no_grad():
            for name, param in base.named_parameters():
                if is_peft:
                    if "lora_" in name or ".original_module." in name:
                        continue  # adapter factors are merged; the trained copy replaces the original
                    name = name.replace(".base_layer.", ".").replace(".modules_to_save.default.", ".")
                yield name, param.detach().to(dtype).contiguous()
    finally:
        if is_peft:
            model.unmerge_adapter()
