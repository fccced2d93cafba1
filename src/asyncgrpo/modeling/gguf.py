"""GGUF files as models: a `.gguf` file becomes a regular model folder, once, in the cache.

Everything that takes a model (trainer, server, tokenizer loading) reads model folders, so a path
ending in `.gguf` is converted into one and the folder is used instead:

    FILE.gguf --transformers' GGUF reader, every tensor dequantized--> <cache>/gguf/<stem>-<hash>/
        config.json            the file's architecture, no quantization_config
        model.safetensors      float32 weights (4 bytes per parameter)
        tokenizer files        the file's vocabulary, merges, special tokens and chat template
        generation_config.json the file's eos (and end-of-turn), bos and pad ids

The weights are stored in float32, so they load exactly into any run dtype; the trainer and the
server read the same folder, so they hold the same weights. The cache is `$ASYNCGRPO_CACHE_DIR`, else
`$XDG_CACHE_HOME/asyncgrpo`, else `~/.cache/asyncgrpo`; the hash covers the file's absolute path,
size and modification time, so a replaced file is converted again.

Invariant: a folder under `<cache>/gguf/` with the final name is complete. Two processes asking at
once (a trainer and its server) convert once: the conversion holds a file lock, writes into a
temporary folder and renames it into place; whoever gets the lock second finds the folder and reuses it.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

__all__ = ["GGUF_SUFFIX", "cache_dir", "gguf_model_folder", "is_gguf_file", "supported_architectures"]

logger = logging.getLogger(__name__)

GGUF_SUFFIX = ".gguf"
GGUF_MAGIC = b"GGUF"
CACHE_ENV = "ASYNCGRPO_CACHE_DIR"
_INSTALL = "pip install 'asyncgrpo[gguf]'"
_ALTERNATIVES = ("convert the model to a folder of safetensors weights (for example its original checkpoint "
                 "on the Hugging Face hub) and pass that folder, or serve the GGUF file with vLLM")


def is_gguf_file(path: str | os.PathLike) -> bool:
    """Whether `path` names a GGUF file (it ends in .gguf, any case, and is not a folder)."""
    return str(path).lower().endswith(GGUF_SUFFIX) and not Path(path).expanduser().is_dir()


def cache_dir() -> Path:
    """`$ASYNCGRPO_CACHE_DIR`, else `$XDG_CACHE_HOME/asyncgrpo`, else `~/.cache/asyncgrpo`."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base).expanduser() / "asyncgrpo"


def supported_architectures() -> list[str]:
    """The GGUF architectures this transformers version reads (`general.architecture` values)."""
    names: set[str] = set()
    try:  # the reader most architectures go through
        from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

        names.update(GGUF_SUPPORTED_ARCHITECTURES)
    except ImportError:
        pass
    try:  # the newer one, for the architectures it covers (transformers >= 5.2x)
        from transformers.integrations.gguf import GGUF_ARCHS

        names.update(GGUF_ARCHS)
    except ImportError:
        pass
    return sorted(names - {"general", "tokenizer"})  # metadata sections, not architectures


def gguf_model_folder(path: str | os.PathLike) -> str:
    """The model folder converted from the GGUF file at `path`: converted now, or reused from the cache.

    Raises:
        FileNotFoundError: no file at `path`.
        ValueError: the file is not a GGUF file, or transformers cannot read its architecture.
        ImportError: the `gguf` package is missing (only when a conversion is needed).
    """
    file = Path(path).expanduser().resolve()
    if not file.is_file():
        raise FileNotFoundError(f"the GGUF file {file} does not exist; pass the path of a .gguf file or a "
                                "model folder")
    with open(file, "rb") as f:
        head = f.read(len(GGUF_MAGIC))
    if head != GGUF_MAGIC:
        raise ValueError(f"{file} is not a GGUF file: it starts with the bytes {head!r}, and a GGUF file "
                         f"starts with {GGUF_MAGIC!r}; pass a .gguf file (as llama.cpp writes them) or a "
                         "model folder")
    stat = file.stat()
    key = hashlib.sha256(f"{file}\0{stat.st_size}\0{stat.st_mtime_ns}".encode()).hexdigest()[:12]
    folder = cache_dir() / "gguf" / f"{file.stem}-{key}"
    if folder.is_dir():
        logger.info("%s: reusing its model folder %s", file.name, folder)
        return str(folder)
    _require_gguf_package()
    if _convert_once(file, folder):
        size = sum(p.stat().st_size for p in folder.iterdir() if p.is_file())
        logger.info("%s: converted into %s (%s on disk)", file.name, folder, _size(size))
    return str(folder)


def _convert_once(file: Path, folder: Path) -> bool:
    """Convert `file` into `folder` unless another process did (False then): under a file lock, through a
    temporary folder renamed into place, so `folder` is complete whenever it exists."""
    from filelock import FileLock, Timeout

    folder.parent.mkdir(parents=True, exist_ok=True)
    lock = FileLock(str(folder.parent / f"{folder.name}.lock"))
    try:
        lock.acquire(timeout=0)
    except Timeout:
        logger.info("%s: another process is converting it into %s; waiting for it", file.name, folder)
        # no timeout: the holder converts (minutes for a large model); the OS frees it if it dies
        lock.acquire()
    try:
        if folder.is_dir():  # converted by the process that held the lock
            logger.info("%s: reusing its model folder %s", file.name, folder)
            return False
        for stale in folder.parent.glob(f".{folder.name}.tmp-*"):  # left by a conversion that died
            shutil.rmtree(stale, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.tmp-", dir=folder.parent))
        try:
            _convert(file, tmp)
            os.rename(tmp, folder)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return True
    finally:
        lock.release()


def _size(num_bytes: int) -> str:
    return f"{num_bytes / 1e9:.2f} GB" if num_bytes >= 1e9 else f"{num_bytes / 1e6:.1f} MB"


def _require_gguf_package() -> None:
    try:
        import gguf  # noqa: F401  (transformers' GGUF reader needs it)
    except ImportError as exc:
        raise ImportError(f"reading GGUF files needs the gguf package: {_INSTALL}") from exc


def _read_metadata(file: Path) -> tuple[dict[str, Any], int]:
    """The file's scalar metadata (strings and numbers, not the token arrays) and its number of weights."""
    import gguf

    reader = gguf.GGUFReader(file)
    metadata: dict[str, Any] = {}
    for name, field in reader.fields.items():
        if len(field.types) != 1:
            continue  # an array
        value = field.parts[field.data[0]]
        metadata[name] = bytes(value).decode("utf-8") if field.types[0] == gguf.GGUFValueType.STRING \
            else value.tolist()[0]
    return metadata, sum(int(t.n_elements) for t in reader.tensors)


def _convert(file: Path, out: Path) -> None:
    """Write the model folder of `file` into `out` (an empty folder)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    metadata, num_weights = _read_metadata(file)
    arch = metadata.get("general.architecture", "?")
    logger.info("%s: converting this %s model (%s) into a model folder of float32 weights (about %s) in %s",
                file.name, arch, _size(file.stat().st_size), _size(4 * num_weights), out.parent)
    where = {"pretrained_model_name_or_path": str(file.parent), "gguf_file": file.name}
    try:
        config = AutoConfig.from_pretrained(**where)
    except ValueError as exc:
        if "not supported" not in str(exc):
            raise
        raise ValueError(f"{file}: transformers cannot read GGUF files of architecture {arch!r} (it reads "
                         f"{', '.join(supported_architectures())}); {_ALTERNATIVES}") from exc
    text = config.get_text_config()
    # llama.cpp's head size; transformers' reader leaves some families (qwen3) at their config's default
    head_dim = metadata.get(f"{arch}.attention.key_length")
    if head_dim and getattr(text, "head_dim", None) not in (None, head_dim):
        logger.info("%s: head_dim %d from attention.key_length (the config's default was %d)", file.name,
                    head_dim, text.head_dim)
        text.head_dim = head_dim
    kwargs: dict[str, Any] = {}
    try:  # transformers >= 5.2x keeps weights in GGUF blocks unless told to dequantize
        from transformers import GgufConfig

        kwargs["quantization_config"] = GgufConfig(dequantize=True)
    except ImportError:
        pass
    model, info = AutoModelForCausalLM.from_pretrained(
        **where, config=config, dtype=torch.float32, use_kernels=False, output_loading_info=True, **kwargs,
    )
    if info["missing_keys"]:
        missing = sorted(info["missing_keys"])
        raise ValueError(f"{file}: transformers found no weights for {len(missing)} parameters of this "
                         f"{arch} model ({', '.join(missing[:3])}, ...): the file's tensor names are not the "
                         f"ones it maps; {_ALTERNATIVES}")
    model.save_pretrained(out)
    tokenizer = AutoTokenizer.from_pretrained(**where)
    tokenizer.model_max_length = getattr(text, "max_position_embeddings", None) or tokenizer.model_max_length
    tokenizer.save_pretrained(out)
    # llama.cpp ends generation at the end-of-turn and end-of-message tokens too
    eos = [metadata[f"tokenizer.ggml.{key}_token_id"] for key in ("eos", "eot", "eom")
           if f"tokenizer.ggml.{key}_token_id" in metadata]
    GenerationConfig(
        eos_token_id=list(dict.fromkeys(eos)) if len(set(eos)) > 1 else (eos[0] if eos else None),
        bos_token_id=metadata.get("tokenizer.ggml.bos_token_id"),
        pad_token_id=metadata.get("tokenizer.ggml.padding_token_id"),
    ).save_pretrained(out)
