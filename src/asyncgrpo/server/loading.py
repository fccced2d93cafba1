"""Loading the served model: device and dtype choice, context length, EOS ids, KV-cache size.

A vision-language checkpoint (Qwen3.5, Qwen3-VL, ...) is loaded whole, as the trainer loads it
(`modeling/load.load_policy`), so parameter names, and with them the weight pushes, are the
checkpoint's (`model.language_model.layers.0...`); only its text model runs (token ids in, no image
features), and prompts holding its image or video placeholder tokens are refused. A hybrid's Gated
DeltaNet layers keep a per-sequence recurrent state (`recurrent_state.py`) instead of KV-cache rows.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch

from asyncgrpo.modeling.load import (
    TORCH_DTYPES,
    is_vision_language,
    load_policy,
    load_tokenizer,
    model_folder_problem,
    resolve_model_path,
    turn_off_hub_kernels,
)
from asyncgrpo.modeling.support import serving_problem
from asyncgrpo.server.fused_layers import FusedLayers, fuse_layers
from asyncgrpo.server.fused_norm import fuse_rms_norms
from asyncgrpo.server.kv_cache import PagedKVCache, register_attention
from asyncgrpo.server.recurrent_state import RecurrentState, serve_deltanet_layers

logger = logging.getLogger(__name__)



class ModelLoadError(ValueError):
    """The model cannot be served as asked (missing files, bad flag): `asyncgrpo serve` prints the
    message, without a traceback, and exits with status 2."""


def _read_config(name: str, path: str):
    """The model's config, or a ModelLoadError saying where it was looked for and what to pass."""
    from transformers import AutoConfig

    problem = model_folder_problem(path)
    if problem is not None:
        raise ModelLoadError(f"cannot serve {name!r}: {problem}")
    try:
        return AutoConfig.from_pretrained(path)
    except OSError as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ModelLoadError(
            f"cannot serve {name!r}: it is not a local folder and could not be loaded from the Hugging Face "
            f"hub ({first}); pass the path of a folder that holds config.json and the weights, or a hub id "
            "that is reachable (or cached, with HF_HUB_OFFLINE=1)"
        ) from exc


@dataclass
class ServedModel:
    model: torch.nn.Module
    tokenizer: object | None
    path: str
    name: str  # the id it was asked for
    device: torch.device
    dtype: torch.dtype
    max_model_len: int
    vocab_size: int
    eos_token_id: int | None
    extra_eos_ids: frozenset[int]
    num_layers: int
    num_kv_heads: int
    head_dim: int
    fused_layers: FusedLayers
    attention_layers: tuple[int, ...]  # the layers with keys/values in the KV cache (all but DeltaNet ones)
    media_token_ids: frozenset[int]  # a vision-language checkpoint's image/video placeholders (refused)


def resolve_device(name: str) -> torch.device:
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError(f"--device {name}: CUDA is not available on this machine; use --device cpu")
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def resolve_dtype(name: str, config_dtype: torch.dtype | None, device: torch.device) -> torch.dtype:
    """`auto`: the checkpoint's half precision dtype if it has one; else float32 on CPU, bfloat16 on GPU."""
    if name != "auto":
        if name not in TORCH_DTYPES:
            raise ModelLoadError(f"--dtype {name!r}: use one of auto, {', '.join(TORCH_DTYPES)}")
        return TORCH_DTYPES[name]
    if config_dtype in (torch.bfloat16, torch.float16):
        return config_dtype
    return torch.float32 if device.type == "cpu" else torch.bfloat16


def _eos_ids(path: str, tokenizer) -> tuple[int | None, frozenset[int]]:
    """Primary EOS (the tokenizer's, else the first of generation_config) and the other EOS ids."""
    from transformers import GenerationConfig

    ids: list[int] = []
    try:
        gen = GenerationConfig.from_pretrained(path)
        eos = gen.eos_token_id
        ids = [eos] if isinstance(eos, int) else list(eos or [])
    except OSError:
        pass  # no generation_config.json: the tokenizer's EOS alone
    primary = getattr(tokenizer, "eos_token_id", None) if tokenizer is not None else None
    if primary is None and ids:
        primary = ids[0]
    return primary, frozenset(i for i in ids if i != primary)


_MEDIA_TOKENS = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")


def prepare_model(model: torch.nn.Module, device: torch.device) -> FusedLayers:
    """Make a loaded model the server's (in place): paged attention, Gated DeltaNet layers reading
    the per-sequence recurrent state, no gradients, fused attention/MLP blocks (and norms on CUDA)."""
    turn_off_hub_kernels(model)  # before the forwards below: hub kernels would replace them
    model.set_attn_implementation(register_attention())
    model.requires_grad_(False)
    layer_types = getattr(model.config.get_text_config(), "layer_types", None) or []
    num_recurrent = serve_deltanet_layers(model, expected=layer_types.count("linear_attention"))
    if num_recurrent:
        logger.info("%d Gated DeltaNet layers keep a per-sequence recurrent state", num_recurrent)
    fused = fuse_layers(model, triton=device.type == "cuda")
    logger.info("%d attention and %d MLP blocks run fused (%d with Triton kernels)", fused.attention,
                fused.mlp, fused.with_triton)
    if device.type == "cuda":
        logger.info("%d norm layers run as one kernel each", fuse_rms_norms(model))
    return fused


def load_served_model(
    name: str, device: torch.device, dtype_name: str, max_model_len: int | None
) -> ServedModel:
    if max_model_len is not None and max_model_len < 1:
        raise ModelLoadError(
            f"--max-model-len {max_model_len}: a sequence needs at least one token; pass a positive length, "
            "or leave the flag out to use the model's max_position_embeddings"
        )
    try:  # a .gguf file is converted here: what is wrong with it (or a missing package) is the user's to fix
        path = resolve_model_path(name)
    except (ImportError, FileNotFoundError, ValueError) as exc:
        raise ModelLoadError(f"cannot serve {name!r}: {exc}") from exc
    config = _read_config(name, path)
    problem = serving_problem(config)  # what the embedded server would serve wrongly
    if problem is not None:
        raise ModelLoadError(f"{name}: {problem}")
    text = config.get_text_config()
    dtype = resolve_dtype(dtype_name, getattr(config, "dtype", None) or getattr(config, "torch_dtype", None),
                          device)
    # a vision-language checkpoint whole (its names are what the trainer pushes), else a causal LM
    model = load_policy(name, dtype=dtype, init_kwargs=None, trust_remote_code=False).to(device).eval()
    logger.info("loaded %s from %s", type(model).__name__, path)
    fused = prepare_model(model, device)
    try:
        tokenizer = load_tokenizer(name)
    except (OSError, ValueError) as exc:
        logger.warning("no tokenizer for %s (%s): text prompts are refused, token ids work", name, exc)
        tokenizer = None
    limit = int(getattr(text, "max_position_embeddings", 0) or 0)
    if max_model_len is None:
        if not limit:
            raise ModelLoadError(f"{name}: the config has no max_position_embeddings; pass --max-model-len")
        max_model_len = limit
    elif limit and max_model_len > limit:
        logger.warning("--max-model-len %d exceeds the model's max_position_embeddings %d", max_model_len,
                       limit)
    heads = text.num_attention_heads
    eos, extra = _eos_ids(path, tokenizer)
    layer_types = getattr(text, "layer_types", None) or ["full_attention"] * text.num_hidden_layers
    media = {getattr(config, key, None) for key in _MEDIA_TOKENS} if is_vision_language(config) else set()
    return ServedModel(
        model=model,
        tokenizer=tokenizer,
        path=path,
        name=name,
        device=device,
        dtype=dtype,
        max_model_len=max_model_len,
        vocab_size=int(text.vocab_size),
        eos_token_id=eos,
        extra_eos_ids=extra,
        num_layers=int(text.num_hidden_layers),
        num_kv_heads=int(getattr(text, "num_key_value_heads", None) or heads),
        head_dim=int(getattr(text, "head_dim", None) or text.hidden_size // heads),
        fused_layers=fused,
        attention_layers=tuple(i for i, kind in enumerate(layer_types) if kind != "linear_attention"),
        media_token_ids=frozenset(int(t) for t in media if t is not None),
    )


def step_activation_bytes(max_num_batched_tokens: int, max_num_seqs: int, hidden_size: int, vocab_size: int,
                          dtype_bytes: int) -> int:
    """Upper estimate of one engine step's transient memory: per batched token ~16 hidden-sized
    activations (q/k/v, attention output, the MLP's gate/up/act at ~3-4x hidden, residuals), and float32
    logits plus their sampling copy for every sequence (only last positions reach the LM head)."""
    return max_num_batched_tokens * hidden_size * dtype_bytes * 16 + max_num_seqs * vocab_size * 4 * 2


def gpu_kv_budget_bytes(total_bytes: int, utilization: float, used_bytes: int, activation_bytes: int) -> int:
    """vLLM's --gpu-memory-utilization: the server may use `utilization` of the WHOLE GPU for weights,
    KV cache and activations together; the KV cache gets what is left of that share after the weights
    already loaded (`used_bytes`) and one step's activations. The rest of the GPU is the trainer's."""
    if not 0 < utilization <= 1:
        raise ModelLoadError(f"--gpu-memory-utilization must be in (0, 1], got {utilization}")
    budget = int(total_bytes * utilization) - used_bytes - activation_bytes
    if budget <= 0:
        raise ModelLoadError(
            f"--gpu-memory-utilization {utilization} gives the server "
            f"{total_bytes * utilization / 2**30:.2f} GiB of the GPU's {total_bytes / 2**30:.2f} GiB, but "
            f"its weights take {used_bytes / 2**30:.2f} GiB and one step's activations "
            f"~{activation_bytes / 2**30:.2f} GiB: raise it, or lower --max-num-batched-tokens"
        )
    return budget


def kv_cache_tokens(requested: int | None, served: ServedModel, max_num_seqs: int, block_size: int,
                    gpu_memory_utilization: float | None = None, max_num_batched_tokens: int = 8192,
                    reserved_before: int = 0) -> int:
    """KV-cache size in tokens (a multiple of block_size).

    Default: room for max_num_seqs full-length sequences, capped on CUDA at 80 % of the memory
    free after loading and on CPU at 30 % of the available RAM, less a hybrid's recurrent state
    (max_num_seqs slots, allocated beside the cache). With `gpu_memory_utilization` (CUDA only) the
    cap is `gpu_kv_budget_bytes` instead, so a trainer on the same GPU keeps the rest; what this
    process held before loading (`reserved_before`: a trainer's, for a server inside its process) is
    not the server's.
    """
    per_token = PagedKVCache.bytes_per_token(len(served.attention_layers), served.num_kv_heads,
                                             served.head_dim, served.dtype)
    if gpu_memory_utilization is not None and (requested is not None or served.device.type != "cuda"):
        raise ModelLoadError(
            "--gpu-memory-utilization sizes the KV cache of a CUDA server: drop it (or --kv-cache-tokens), "
            f"the server runs on {served.device} with --kv-cache-tokens {requested}"
        )
    if requested is None:
        want = max_num_seqs * served.max_model_len
        if gpu_memory_utilization is not None:
            _, total = torch.cuda.mem_get_info(served.device)
            hidden = served.model.get_input_embeddings().embedding_dim
            activations = step_activation_bytes(max_num_batched_tokens, max_num_seqs, hidden,
                                                served.vocab_size, served.dtype.itemsize)
            budget = gpu_kv_budget_bytes(total, gpu_memory_utilization,
                                         torch.cuda.memory_reserved(served.device) - reserved_before,
                                        activations)
        elif served.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(served.device)
            budget = int(0.8 * free)
        else:
            budget = int(0.3 * os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
        # a hybrid's DeltaNet state: a slot per sequence, and the CUDA graphs' scratch slot
        recurrent_bytes = (max_num_seqs + 1) * RecurrentState.bytes_per_sequence(served.model)
        cap = max(budget - recurrent_bytes, 0) // per_token
        tokens = min(want, cap)
    else:
        tokens = requested
    tokens = tokens // block_size * block_size
    if tokens < served.max_model_len:
        raise ModelLoadError(
            f"the KV cache holds {tokens} tokens, less than one sequence of "
            f"max_model_len={served.max_model_len}: raise --kv-cache-tokens or lower --max-model-len"
        )
    logger.info("KV cache: %d tokens (%.2f GiB)", tokens, tokens * per_token / 2**30)
    return tokens
