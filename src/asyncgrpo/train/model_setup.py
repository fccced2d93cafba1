"""The policy model: prepared for training, and its parts the loss needs.

The loss never asks the model for logits: `hidden_states_and_head` returns the transformer body's
hidden states for the packed row and the LM head, and `asyncgrpo.train.logprobs` computes log-probs
only at trained positions, chunk by chunk. What a weight sync sends (full tensors, merged adapters,
sharded parameters gathered) is `asyncgrpo.train.weights.gather.weights_for_server`.

A vision-language checkpoint (Qwen3.5, Qwen3-VL, ...) is loaded whole (`modeling/load.py`), with the
architecture its config declares (`AutoModelForImageTextToText`), so parameter names stay the checkpoint's
(`model.language_model.layers.0...`), which is what vLLM's loader maps. Only its text model trains
on text-only prompts: everything else (vision tower, projector) is frozen by `train_text_model_only`
and left out of the weight sync, so the server keeps what it loaded from the checkpoint.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from transformers import AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from asyncgrpo.modeling.load import is_vision_language, load_policy, resolve_model_path
from asyncgrpo.modeling.support import check_supported
from asyncgrpo.packing.attention import enable_tree_attention

logger = logging.getLogger(__name__)


def prepare_policy(model: str | PreTrainedModel, args: Any) -> tuple[PreTrainedModel, str]:
    """(the model to train, its id): loaded when `model` is an id or path, checked for tree packing, its
    attention switched to the tree-attention backend; of a vision-language model only the text model
    trains."""
    if isinstance(model, str):
        model_id = model
        model = load_policy(
            model,
            dtype=args.dtype,
            init_kwargs=args.model_init_kwargs,
            trust_remote_code=args.trust_remote_code,
        )
    elif isinstance(model, PreTrainedModel):
        model_id = model.config._name_or_path
    else:
        raise TypeError(
            f"`model` must be a model id, a path or a PreTrainedModel, got {type(model).__name__}"
        )
    check_supported(model.config)
    enable_tree_attention(model)
    train_text_model_only(model)  # a vision-language checkpoint trains its text model, on text-only prompts
    return model, model_id


def train_text_model_only(model: PreTrainedModel) -> None:
    """Freeze everything of a vision-language model outside its text model (decoder and LM head):
    no gradients, no optimizer state (the Trainer's optimizer takes only `requires_grad` parameters).
    A causal LM is left as it is."""
    if not is_vision_language(model.config):
        return
    text = text_parameter_ids(model)
    frozen = 0
    for param in model.parameters():
        if id(param) not in text:
            param.requires_grad_(False)
            frozen += param.numel()
    total = sum(p.numel() for p in model.parameters())
    logger.info("%s is a vision-language model: training its text model only (%.1f%% of %d parameters "
                "frozen: vision "
                "tower and projector, which the weight sync leaves out)", type(model).__name__,
                100 * frozen / max(total, 1), total)


def text_parameter_ids(model: torch.nn.Module) -> set[int]:
    """The ids of the parameters that train: the text model's (decoder body and LM head)."""
    body, head = decoder_and_head(model)
    return {id(p) for module in (body, head) for p in module.parameters()}


def wrap_peft(model: PreTrainedModel, peft_config: Any) -> Any:
    """The model with PEFT adapters (synced merged); adapters on lm_head are refused."""
    from peft import get_peft_model

    targets = getattr(peft_config, "target_modules", None) or []  # not every PEFT method has them
    if isinstance(targets, str):
        targets = [targets]
    if "lm_head" in targets or "lm_head" in (getattr(peft_config, "modules_to_save", None) or []):
        raise ValueError(
            "PEFT adapters on lm_head are not supported: remove lm_head from target_modules/modules_to_save"
        )
    return get_peft_model(model, peft_config)


def load_tokenizer(
    model_id: str, *, trust_remote_code: bool, revision: str | None = None
) -> PreTrainedTokenizerBase:
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
        elif (
            hasattr(m, "module")
            and isinstance(m.module, torch.nn.Module)
            and not isinstance(m, PreTrainedModel)
        ):
            m = m.module  # DDP
        else:
            return m


def decoder_and_head(model: torch.nn.Module) -> tuple[torch.nn.Module, torch.nn.Linear]:
    """(transformer body returning hidden states, LM head) of a causal LM."""
    base = unwrap(model)
    head = base.get_output_embeddings()
    body = base.get_decoder() if hasattr(base, "get_decoder") else getattr(base, base.base_model_prefix)
    if head is None or body is None:
        raise ValueError(
            f"{type(base).__name__} has no separable decoder and LM head; it cannot be trained here"
        )
    return body, head


def hidden_states_and_head(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    position_ids: torch.Tensor,
    *,
    router_aux_loss: bool = False,
) -> tuple[torch.Tensor, torch.nn.Linear, torch.Tensor | None]:
    """The body's last hidden states [T, H] for one packed row (`input_ids`, `position_ids`: [T]), the
    LM head, whose weight the caller multiplies in at the trained positions only, and, with
    `router_aux_loss` (Mixture-of-Experts models), the model's own load-balancing loss over the row's
    forwarded tokens (a 0-d tensor; None otherwise).

    The forward runs through `model` itself (the module the Trainer wrapped), not the body alone: DDP
    synchronises gradients only of a forward it ran, and FSDP2 gathers the parameters outside the
    decoder layers (embeddings, final norm, LM head) in the forward hooks of the root or of their own
    unit. The root computes logits for one position only (`logits_to_keep=1`); the body's output is
    taken with a forward hook. FSDP2 keeps the root and the LM head's unit gathered after forward
    (they are needed again at once in backward), so the head's weight is the full tensor here.
    """
    body, head = decoder_and_head(model)
    captured: list[torch.Tensor] = []

    def keep(module: torch.nn.Module, args: Any, output: Any) -> None:
        captured.append(output.last_hidden_state if hasattr(output, "last_hidden_state") else output[0])

    kwargs = {"output_router_logits": True} if router_aux_loss else {}
    handle = body.register_forward_hook(keep)
    try:
        out = model(
            input_ids=input_ids[None],
            position_ids=position_ids[None],
            use_cache=False,
            logits_to_keep=1,
            **kwargs,
        )
    finally:
        handle.remove()
    assert len(captured) == 1, f"the decoder body ran {len(captured)} times in one forward"
    return captured[0][0], head, out.aux_loss if router_aux_loss else None


def router_aux_loss_coef(config: Any, requested: float | None) -> float:
    """The weight of a Mixture-of-Experts model's load-balancing loss: `requested`, or the model
    config's `router_aux_loss_coef` when None; 0.0 for a model without a router (asking for a
    positive weight there is an error)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    has_router = hasattr(text, "output_router_logits") and hasattr(text, "router_aux_loss_coef")
    if not has_router:
        if requested:
            raise ValueError(
                f"router_aux_loss_coef={requested}, but model type {text.model_type!r} has no router (it is "
                "not a Mixture-of-Experts model): leave router_aux_loss_coef=None"
            )
        return 0.0
    return float(text.router_aux_loss_coef if requested is None else requested)


# Families whose forward scales `hidden @ W` (checked against each model's own forward in
# tests/packing/test_tree_attention.py): Cohere multiplies by `logit_scale`, Granite divides by
# `logits_scaling`. Gemma 2/3 softcap with `final_logit_softcapping`.
_LOGIT_MULTIPLIER = {"cohere": "logit_scale", "cohere2": "logit_scale"}
_LOGIT_DIVISOR = {
    "granite": "logits_scaling",
    "granitemoe": "logits_scaling",
    "granitemoeshared": "logits_scaling",
}


def logit_processing(config: Any) -> dict[str, float | None]:
    """What the model's own forward does to `hidden @ W` before the log-softmax, as the
    `logit_scale` / `logit_softcapping` keyword arguments of `asyncgrpo.train.logprobs.token_logprobs`."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    model_type = getattr(text, "model_type", None)
    scale = 1.0
    if model_type in _LOGIT_MULTIPLIER:
        scale = float(getattr(text, _LOGIT_MULTIPLIER[model_type]))
    elif model_type in _LOGIT_DIVISOR:
        scale = 1.0 / float(getattr(text, _LOGIT_DIVISOR[model_type]))
    return {"logit_scale": scale, "logit_softcapping": getattr(text, "final_logit_softcapping", None)}
