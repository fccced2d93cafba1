"""Which model families the trainer and the embedded server run; the others are refused at start.

Training (`check_supported`). Tree packing replaces only the attention kernel: every other layer
must act on each token alone (or read positions from `position_ids`, which hold trie depths). So a
model is supported when all its sequence mixing is causal self-attention routed through
transformers' AttentionInterface, with RoPE or no positional term, optionally a sliding window and
logit softcapping, plus the Gated DeltaNet layers of Qwen's hybrids (`packing/deltanet.py`: the
convolution reads each token's trie path, the delta rule starts each segment from its parent's final
state; transformers >= 5.15). Refused: attention sinks, other linear-attention / state-space /
convolution layers, ALiBi or other position biases, chunked attention, bidirectional or
encoder-decoder models, attention dropout (FlexAttention has none).

`SUPPORTED_MODEL_TYPES` lists the types whose packed log-probs were checked against unpacked ones
(tests/packing/test_tree_attention.py and tests/packing/test_tree_deltanet.py build a tiny random model
of each). Vision-language checkpoints of `VISION_LANGUAGE_MODEL_TYPES` are supported for their
text model (trained on text-only prompts, the vision tower frozen). Anything else is refused with
the reason, so an unverified architecture never trains on silently wrong attention.

Serving (`serving_problem`). The embedded server runs full and sliding-window attention layers and
Gated DeltaNet layers, and of a multimodal checkpoint only the text model of the vision-language
families above; anything else is refused at load, naming vLLM as the way to serve it.
"""

from __future__ import annotations

__all__ = ["DELTANET_MODEL_TYPES", "SERVED_LAYER_TYPES", "SUPPORTED_MODEL_TYPES",
           "VISION_LANGUAGE_MODEL_TYPES", "check_supported", "serving_problem"]

DELTANET_MODEL_TYPES: frozenset[str] = frozenset({"qwen3_5_text", "qwen3_5_moe_text", "qwen3_next"})
"""Hybrids whose `linear_attention` layers are Gated DeltaNet layers tree packing runs."""

SUPPORTED_MODEL_TYPES: frozenset[str] = frozenset({
    "apertus", "arcee", "cohere2", "ernie4_5", "exaone4", "gemma", "gemma2", "gemma3_text", "glm4",
    "granite", "helium", "hunyuan_v1_dense", "llama", "ministral", "mistral", "olmo2", "olmo3", "phi3",
    "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "seed_oss", "smollm3", "starcoder2", *DELTANET_MODEL_TYPES,
})

VISION_LANGUAGE_MODEL_TYPES: dict[str, str] = {
    "qwen3_5": "qwen3_5_text", "qwen3_5_moe": "qwen3_5_moe_text", "qwen3_vl": "qwen3_vl_text",
    "qwen3_vl_moe": "qwen3_vl_moe_text",
}
"""Vision-language checkpoints whose text model (this model type) trains on text-only prompts."""

_MIN_DELTANET_TRANSFORMERS = (5, 15)

_REFUSED: dict[str, str] = {
    **dict.fromkeys(("gpt_oss",), "its attention has learned sinks (an extra softmax term per head)"),
    **dict.fromkeys(
        ("kimi_linear", "olmo3_2_hybrid"),
        "its linear-attention layers have not been verified with tree packing (verified: the Gated DeltaNet "
        "layers of Qwen3.5, Qwen3.5-MoE and Qwen3-Next)"),
    **dict.fromkeys(
        ("mamba", "mamba2", "falcon_mamba", "jamba", "zamba", "zamba2", "bamba", "granitemoehybrid",
         "nemotron_h", "falcon_h1", "rwkv", "recurrent_gemma", "lfm2", "lfm2_moe", "minimax", "plamo2",
         "hymba", "xlstm"),
        "it has recurrent, state-space or convolution layers that mix tokens outside attention"),
    **dict.fromkeys(("bloom", "mpt", "jais", "falcon"), "its attention uses ALiBi position biases"),
    **dict.fromkeys(("llama4", "llama4_text"), "it uses chunked attention (attention_chunk_size)"),
}

_ATTENTION_LAYER_TYPES = {"full_attention", "sliding_attention"}


def check_supported(config) -> None:
    """Raise ValueError naming the model type and the reason if tree packing cannot run `config`."""
    model_type = getattr(config, "model_type", None) or type(config).__name__
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    if text_config is not config and text_config is not None:
        if model_type not in VISION_LANGUAGE_MODEL_TYPES:
            raise ValueError(f"model type {model_type!r} is a multimodal model that tree packing has not "
                             f"been verified with (vision-language checkpoints trained on their text model: "
                             f"{', '.join(sorted(VISION_LANGUAGE_MODEL_TYPES))}); load its text model, model "
                             f"type {text_config.model_type!r}, instead")
        check_supported(text_config)
        return

    def refuse(reason: str) -> ValueError:
        return ValueError(f"model type {model_type!r} is not supported by tree packing: {reason}")

    if model_type in _REFUSED:
        raise refuse(_REFUSED[model_type])
    if getattr(config, "is_encoder_decoder", False):
        raise refuse("encoder-decoder models are not supported; tree packing trains causal LMs")
    if not getattr(config, "is_causal", True) or getattr(config, "use_bidirectional_attention", False):
        raise refuse("its attention is bidirectional")
    if getattr(config, "attention_chunk_size", None):
        raise refuse("it uses chunked attention (attention_chunk_size)")
    layer_types = set(getattr(config, "layer_types", None) or ())
    allowed = _ATTENTION_LAYER_TYPES | ({"linear_attention"} if model_type in DELTANET_MODEL_TYPES else set())
    other_layers = sorted(layer_types - allowed)
    if other_layers:
        raise refuse(f"it has layers of type {other_layers}; tree packing runs full and sliding-window "
                     "causal self-attention layers, and the Gated DeltaNet layers of "
                     f"{', '.join(sorted(DELTANET_MODEL_TYPES))}")
    if "linear_attention" in layer_types:
        _check_transformers_version(model_type)
    if getattr(config, "alibi", False):
        raise refuse("its attention uses ALiBi position biases")
    if (getattr(config, "attention_dropout", 0.0) or 0.0) > 0:
        raise ValueError(f"model type {model_type!r} has attention_dropout={config.attention_dropout}; tree "
                         "attention runs without attention dropout: set config.attention_dropout = 0.0")
    if model_type not in SUPPORTED_MODEL_TYPES and model_type not in VISION_LANGUAGE_MODEL_TYPES.values():
        raise refuse(
            f"it has not been verified with tree attention (verified: "
            f"{', '.join(sorted(SUPPORTED_MODEL_TYPES))}). If its token mixing is plain causal "
            "self-attention through transformers' AttentionInterface, add it to "
            "asyncgrpo.modeling.support.SUPPORTED_MODEL_TYPES once tests/packing/test_tree_attention.py "
            "passes with a tiny config of it")


def _check_transformers_version(model_type: str) -> None:
    import transformers

    installed = tuple(int(part) for part in transformers.__version__.split(".")[:2] if part.isdigit())
    if installed < _MIN_DELTANET_TRANSFORMERS:
        need = ".".join(map(str, _MIN_DELTANET_TRANSFORMERS))
        raise ValueError(f"model type {model_type!r} has Gated DeltaNet layers, which tree packing runs with "
                         f"transformers >= {need} (installed: {transformers.__version__}); "
                         f"pip install 'transformers>={need}'")


SERVED_LAYER_TYPES: frozenset[str] = frozenset({"full_attention", "sliding_attention", "linear_attention"})
"""Layer types the embedded server runs (`linear_attention`: Gated DeltaNet layers)."""


def serving_problem(config) -> str | None:
    """Why the embedded server would serve `config` wrongly, or None: layer types other than
    (sliding-window) attention and Gated DeltaNet, vision-language families whose text model was not
    verified."""
    text = config.get_text_config()
    if text is not config and config.model_type not in VISION_LANGUAGE_MODEL_TYPES:
        return (f"model type {config.model_type!r} is a multimodal model the embedded server does not serve "
                f"(vision-language checkpoints it serves the text model of: "
                f"{', '.join(sorted(VISION_LANGUAGE_MODEL_TYPES))}); serve it with vLLM")
    layer_types = set(getattr(text, "layer_types", None) or ())
    if layer_types - SERVED_LAYER_TYPES:
        return (f"layers of type {sorted(layer_types - SERVED_LAYER_TYPES)} are not supported by the "
                "embedded server (it runs full and sliding-window attention and Gated DeltaNet layers); "
                "serve it with vLLM")
    return None
