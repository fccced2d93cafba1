"""Which model architectures tree packing can run exactly; refuse the others at start.

Tree attention replaces only the attention kernel: every other layer must act on each token alone
(or read positions from `position_ids`, which hold trie depths). So a model is supported when all
its sequence mixing is causal self-attention routed through transformers' AttentionInterface,
with RoPE or no positional term, optionally a sliding window and logit softcapping. Refused:
attention sinks, linear-attention / state-space / convolution layers (Gated DeltaNet hybrids are
planned, DESIGN 5), ALiBi or other position biases, chunked attention, bidirectional or
encoder-decoder models, attention dropout (FlexAttention has none).

`SUPPORTED_MODEL_TYPES` lists the types whose packed log-probs were checked against unpacked ones
(tests/unit/test_tree_attention.py builds a tiny random model of each). Anything else is refused
with the reason, so an unverified architecture never trains on silently wrong attention.
"""

from __future__ import annotations

__all__ = ["SUPPORTED_MODEL_TYPES", "check_supported"]

SUPPORTED_MODEL_TYPES: frozenset[str] = frozenset({
    "apertus", "arcee", "cohere2", "ernie4_5", "exaone4", "gemma", "gemma2", "gemma3_text", "glm4",
    "granite", "helium", "hunyuan_v1_dense", "llama", "ministral", "mistral", "olmo2", "olmo3", "phi3",
    "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "seed_oss", "smollm3", "starcoder2",
})

_REFUSED: dict[str, str] = {
    **dict.fromkeys(("gpt_oss",), "its attention has learned sinks (an extra softmax term per head)"),
    **dict.fromkeys(
        ("qwen3_next", "qwen3_5", "qwen3_5_moe", "qwen3_5_text", "qwen3_5_moe_text", "kimi_linear", "olmo3_2_hybrid"),
        "it has Gated DeltaNet (linear attention) layers, which tree packing does not run yet"),
    **dict.fromkeys(
        ("mamba", "mamba2", "falcon_mamba", "jamba", "zamba", "zamba2", "bamba", "granitemoehybrid", "nemotron_h",
         "falcon_h1", "rwkv", "recurrent_gemma", "lfm2", "lfm2_moe", "minimax", "plamo2", "hymba", "xlstm"),
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
        raise ValueError(f"model type {model_type!r} is a multimodal model; tree packing trains text-only "
                         f"causal LMs (load its text model, model type {text_config.model_type!r}, instead)")

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
    other_layers = sorted(layer_types - _ATTENTION_LAYER_TYPES)
    if other_layers:
        raise refuse(f"it has layers of type {other_layers}; tree attention runs only full and sliding-window "
                     "causal self-attention layers")
    if getattr(config, "alibi", False):
        raise refuse("its attention uses ALiBi position biases")
    if (getattr(config, "attention_dropout", 0.0) or 0.0) > 0:
        raise ValueError(f"model type {model_type!r} has attention_dropout={config.attention_dropout}; tree "
                         "attention runs without attention dropout: set config.attention_dropout = 0.0")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise refuse(
            f"it has not been verified with tree attention (verified: {', '.join(sorted(SUPPORTED_MODEL_TYPES))}). "
            "If its token mixing is plain causal self-attention through transformers' AttentionInterface, add it "
            "to asyncgrpo.packing.model_support.SUPPORTED_MODEL_TYPES once tests/unit/test_tree_attention.py "
            "passes with a tiny config of it")
