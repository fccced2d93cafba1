"""Loading a model: model ids the package resolves itself, the dtype names, and the loaders everything
else calls (trainer, embedded server, examples, benchmarks).

``BUNDLED_MODELS`` maps ids such as ``"asyncgrpo/tiny-chat"`` to folders shipped inside the package
(``assets/``), so nothing is fetched from a hub for them. Every place that accepts a model id passes
it through ``resolve_model_path`` first: a bundled id becomes its local folder, a ``.gguf`` file the
model folder converted from it (``asyncgrpo.modeling.gguf``), an existing local path stays itself, and
anything else (a hub id) is returned unchanged for transformers to handle.

``load_policy`` is how the trainer and the embedded server load the model they share: a
vision-language checkpoint (Qwen3.5, Qwen3-VL, ...) whole, with the architecture its config declares
(``AutoModelForImageTextToText``), so parameter names, and with them the weight pushes, are the
checkpoint's (``model.language_model.layers.0...``); anything else as a causal LM. Models load with
hub kernels off (``use_kernels=False``); ``turn_off_hub_kernels`` undoes them on a model loaded elsewhere.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from transformers import PreTrainedConfig, PreTrainedModel

__all__ = ["BUNDLED_MODELS", "TORCH_DTYPES", "is_vision_language", "load_causal_lm", "load_policy",
           "load_tokenizer", "model_folder_problem", "resolve_model_path", "turn_off_hub_kernels"]

logger = logging.getLogger(__name__)

_ASSETS = Path(__file__).resolve().parent.parent / "assets"

BUNDLED_MODELS: dict[str, str] = {
    "asyncgrpo/tiny-chat": str(_ASSETS / "tiny_chat"),
}
"""Bundled model id -> folder with config, safetensors, tokenizer and chat template."""


def resolve_model_path(name_or_path: str) -> str:
    """Map a bundled model id to its folder inside the installed package, a GGUF file to its model folder.

    Args:
        name_or_path: A bundled id (``"asyncgrpo/tiny-chat"``), a ``.gguf`` file, a local path, or a hub id.

    Returns:
        The bundled folder for a bundled id; for a ``.gguf`` file the model folder converted from it,
        once, in the cache (``asyncgrpo.modeling.gguf``); ``name_or_path`` itself otherwise (a local
        path that exists, or a hub id that transformers resolves).

    Raises:
        FileNotFoundError: The id is bundled but its folder is missing from this installation, or
            the ``.gguf`` file does not exist.
        ValueError: The ``.gguf`` file is not a GGUF file, or of an architecture transformers cannot read.
        ImportError: The ``gguf`` package, needed to convert a ``.gguf`` file, is missing.
    """
    from asyncgrpo.modeling.gguf import gguf_model_folder, is_gguf_file  # stdlib only until it converts

    name_or_path = str(name_or_path)
    if is_gguf_file(name_or_path):
        return gguf_model_folder(name_or_path)
    if name_or_path in BUNDLED_MODELS:
        path = BUNDLED_MODELS[name_or_path]
        if not (Path(path) / "config.json").is_file():
            raise FileNotFoundError(
                f"bundled model {name_or_path!r} is missing its files in {path}; rebuild them with "
                "`python scripts/build_tiny_model.py` or reinstall asyncgrpo"
            )
        return path
    return name_or_path


def model_folder_problem(path: str) -> str | None:
    """What is wrong with a model path that names a local folder (absolute, starting with '.' or '~', or
    existing), or None: the folder must hold config.json. A .gguf file is resolve_model_path's to check.
    Anything else is a hub id, the hub's to resolve (transformers would take a missing folder for a
    malformed hub id and say only that)."""
    from asyncgrpo.modeling.gguf import is_gguf_file

    local = Path(path).expanduser()
    looks_local = local.is_absolute() or str(path).startswith((".", "~")) or local.exists()
    if not looks_local or (local / "config.json").is_file() or is_gguf_file(path):
        return None
    what = "does not exist" if not local.exists() else "has no config.json"
    return (f"the folder {local} {what}; pass a folder that holds config.json and the weights (e.g. one "
            "written by save_pretrained), or a Hugging Face hub id")


TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
"""The dtype names a run or a server accepts (`dtype=`, `--dtype`), besides "auto"."""
_DTYPES = {**TORCH_DTYPES, "auto": "auto"}


def is_vision_language(config: PreTrainedConfig) -> bool:
    """Whether `config` declares a vision-language architecture (an image-text-to-text model)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    return config.model_type in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES


def load_policy(model_id: str, *, dtype: str, init_kwargs: dict | None,
                trust_remote_code: bool) -> PreTrainedModel:
    """Load a model from an id or path (bundled ids such as `asyncgrpo/tiny-chat` included): a
    vision-language checkpoint whole (`AutoModelForImageTextToText`), anything else as a causal LM."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    kwargs = dict(init_kwargs or {})
    kwargs.setdefault("dtype", _DTYPES.get(kwargs.pop("torch_dtype", None) or dtype, dtype))
    kwargs.setdefault("trust_remote_code", trust_remote_code)
    # hub kernels would replace the forwards we install (turn_off_hub_kernels)
    kwargs.setdefault("use_kernels", False)
    path = resolve_model_path(model_id)
    problem = model_folder_problem(path)
    if problem is not None:
        raise FileNotFoundError(f"cannot load model {model_id!r}: {problem}")
    config_kwargs = {key: kwargs[key] for key in ("revision", "trust_remote_code", "token", "cache_dir",
                                                  "subfolder") if key in kwargs}
    config = AutoConfig.from_pretrained(path, **config_kwargs)
    auto_class = AutoModelForImageTextToText if is_vision_language(config) else AutoModelForCausalLM
    return auto_class.from_pretrained(path, **kwargs)


def load_tokenizer(name_or_path: str, **kwargs: Any):
    """Load the tokenizer (with its chat template) of a bundled id, local path or hub id.

    Args:
        name_or_path: See ``resolve_model_path``.
        **kwargs: Passed to ``transformers.AutoTokenizer.from_pretrained``.
    """
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(resolve_model_path(name_or_path), **kwargs)


def load_causal_lm(name_or_path: str, dtype: Any = "auto", device: Any = None, **kwargs: Any):
    """Load a causal language model of a bundled id, local path or hub id.

    Args:
        name_or_path: See ``resolve_model_path``.
        dtype: Parameter dtype (``torch.bfloat16``, ``"float32"``); ``"auto"`` keeps the stored
            dtype (float32 for the bundled tiny model).
        device: Device to move the model to (``"cuda"``, ``torch.device("cpu")``); None leaves it
            where transformers loads it (CPU unless ``device_map`` is passed).
        **kwargs: Passed to ``transformers.AutoModelForCausalLM.from_pretrained``.

    Returns:
        The model in eval mode.
    """
    from transformers import AutoModelForCausalLM

    path = resolve_model_path(name_or_path)
    kwargs.setdefault("use_kernels", False)  # see turn_off_hub_kernels
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **kwargs)
    if device is not None:
        model = model.to(device)
    logger.info("loaded %s from %s", type(model).__name__, path)
    return model.eval()


def turn_off_hub_kernels(model: Any) -> None:
    """Give every layer of `model` that transformers kernelized with a kernel from the Hub its own
    forward back, and keep it so.

    transformers >= 5.2x loads models with hub kernels on where the `kernels` package is installed,
    and kernelizes again at every train()/eval(): the decorated layers (Gated DeltaNet, norms, MLPs)
    get their forward replaced, and a forward the trainer or the server installed on them (tree
    packing, the per-sequence recurrent state, fused blocks) silently with it. Hub kernels would also
    be downloaded at run time. Call before installing such forwards; models are loaded with
    `use_kernels=False` already, this also covers a model passed in loaded."""
    from transformers import PreTrainedModel

    for module in model.modules():
        if not (isinstance(module, PreTrainedModel) and getattr(module, "use_kernels", False)):
            continue
        if not hasattr(module, "reset_kernels"):
            logger.warning("%s was loaded with use_kernels=True, which this transformers version cannot "
                           "undo: load it with use_kernels=False (hub kernels replace the forwards this "
                           "package installs)", type(module).__name__)
            continue
        logger.info("%s: hub kernels turned off (their forwards would replace the ones this package installs "
                    "at every train()/eval())", type(module).__name__)
        module.reset_kernels()
