"""Writing small GGUF files from transformers models, as llama.cpp's converter lays them out.

Tests of `asyncgrpo.modeling.gguf` need GGUF files whose weights are known: `write_gguf` takes a model
and its tokenizer and writes one with the `gguf` package's writer (tensor names from its name map,
llama's q/k rows permuted as llama.cpp's converter permutes them, the tokenizer as a byte-level BPE
vocabulary with its merges and chat template), so a test can compare whatever is read back with the
model it wrote.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

TINY_CHAT = "asyncgrpo/tiny-chat"


def tiny_llama(tokenizer, seed: int = 0):
    """A random 2-layer LlamaForCausalLM (hidden 64, 4 query / 2 key-value heads, untied head) over
    `tokenizer`'s vocabulary, in float32."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6, tie_word_embeddings=False,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, bos_token_id=None,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():  # random norms: a wrong norm mapping would not go unnoticed
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)
    return model


def _llama_permute(weight: np.ndarray, num_heads: int, num_kv_heads: int) -> np.ndarray:
    """llama.cpp's `LlamaModel.permute`: q/k rows from the HF rotary layout (halves) to interleaved pairs."""
    if num_kv_heads != num_heads:
        num_heads = num_kv_heads
    return (weight.reshape(num_heads, 2, weight.shape[0] // num_heads // 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))


def _token_table(tokenizer) -> tuple[list[str], list[int]]:
    """Every token by id (byte-level spelling) and its llama.cpp token type: control for special added
    tokens, user-defined for other added tokens, normal otherwise."""
    import gguf

    by_id = {index: token for token, index in tokenizer.get_vocab().items()}
    added = tokenizer.added_tokens_decoder
    tokens, types = [], []
    for index in range(len(by_id)):
        tokens.append(by_id[index])
        if index in added:
            types.append(gguf.TokenType.CONTROL if added[index].special else gguf.TokenType.USER_DEFINED)
        else:
            types.append(gguf.TokenType.NORMAL)
    return tokens, [int(t) for t in types]


def _merges(tokenizer) -> list[str]:
    merges = json.loads(tokenizer.backend_tokenizer.to_str())["model"]["merges"]
    return [m if isinstance(m, str) else " ".join(m) for m in merges]


def write_gguf(path: str | Path, model, tokenizer, *, qtype: str = "F32", pre_tokenizer: str = "qwen2",
               name: str = "tiny test model") -> Path:
    """Write `model` (a Llama or Qwen3 causal LM) and `tokenizer` (byte-level BPE) to a GGUF file.

    Args:
        qtype: the ggml type of the 2-D weights ("F32", "F16", "Q8_0", ...); norms stay F32, as
            llama.cpp keeps them.
        pre_tokenizer: `tokenizer.ggml.pre`, which chooses the split regex on reading.
    """
    import gguf

    path = Path(path)
    config = model.config
    arch = {"llama": "llama", "qwen3": "qwen3"}[config.model_type]
    arch_enum = next(key for key, value in gguf.MODEL_ARCH_NAMES.items() if value == arch)
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    names = gguf.get_tensor_name_map(arch_enum, config.num_hidden_layers)
    quant = gguf.GGMLQuantizationType[qtype]

    writer = gguf.GGUFWriter(path, arch)
    writer.add_name(name)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(float(config.rope_parameters["rope_theta"]))
    writer.add_layer_norm_rms_eps(float(config.rms_norm_eps))
    writer.add_rope_dimension_count(head_dim)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_vocab_size(config.vocab_size)
    writer.add_file_type({"F32": gguf.LlamaFileType.ALL_F32, "F16": gguf.LlamaFileType.MOSTLY_F16}.get(
        qtype, gguf.LlamaFileType.MOSTLY_Q8_0))

    tokens, types = _token_table(tokenizer)
    assert len(tokens) == config.vocab_size, (len(tokens), config.vocab_size)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre_tokenizer)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(_merges(tokenizer))
    writer.add_eos_token_id(tokenizer.eos_token_id)
    if tokenizer.pad_token_id is not None:
        writer.add_pad_token_id(tokenizer.pad_token_id)
    writer.add_add_bos_token(False)
    if tokenizer.chat_template:
        writer.add_chat_template(tokenizer.chat_template)

    for hf_name, tensor in model.state_dict().items():
        if hf_name == "lm_head.weight" and config.tie_word_embeddings:
            continue  # a tied head is the token embedding: llama.cpp writes no `output` tensor
        gguf_name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        assert gguf_name is not None, f"no GGUF name for {hf_name}"
        data = tensor.detach().to(torch.float32).numpy()
        if arch == "llama" and hf_name.endswith("q_proj.weight"):
            data = _llama_permute(data, heads, heads)
        elif arch == "llama" and hf_name.endswith("k_proj.weight"):
            data = _llama_permute(data, heads, kv_heads)
        if data.ndim == 1 or quant == gguf.GGMLQuantizationType.F32:
            writer.add_tensor(gguf_name, np.ascontiguousarray(data, dtype=np.float32))
        elif quant == gguf.GGMLQuantizationType.F16:
            writer.add_tensor(gguf_name, np.ascontiguousarray(data, dtype=np.float16))
        else:
            packed = gguf.quants.quantize(np.ascontiguousarray(data), quant)
            writer.add_tensor(gguf_name, packed, raw_dtype=quant)

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
