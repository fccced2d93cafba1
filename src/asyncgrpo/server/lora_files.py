"""Reading a PEFT LoRA adapter directory for the embedded server (what `/v1/load_lora_adapter` loads).

A directory written by `PeftModel.save_pretrained` holds `adapter_config.json` and
`adapter_model.safetensors`, whose tensors are named

    base_model.model.<module path>.lora_A.weight   [r, in_features]
    base_model.model.<module path>.lora_B.weight   [out_features, r]

and a module's output gains `scaling * B @ A @ x`, scaling = alpha / r (alpha / sqrt(r) with
`use_rslora`), r and alpha taken from `rank_pattern` / `alpha_pattern` where one matches the module.
The checks follow vLLM 0.33 (`lora/peft_helper.py`, `lora/lora_model.py`) and its messages, with the
fix appended: a missing directory or config is `AdapterNotFound` (404), anything else an
`AdapterLoadError` (500); the allowed ranks and inits are the trainer's too (`modeling/lora_rules.py`).
Pure I/O: the tensors come back on the CPU in float32, scaling folded into B.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from asyncgrpo.modeling.lora_rules import PLAIN_LORA_INITS, max_lora_ranks_for

if TYPE_CHECKING:  # torch only for annotations: reading an adapter's config needs none
    import torch

_PREFIX = "base_model.model."
_SUFFIXES = (".lora_A.weight", ".lora_B.weight")


class AdapterNotFound(Exception):
    """No adapter at the path (vLLM's LoRAAdapterNotFoundError: 404 NotFoundError)."""

    def __init__(self, name: str, path: str) -> None:
        super().__init__(f"Loading lora {name} failed: No adapter found for {path}")


class AdapterLoadError(Exception):
    """The adapter exists but cannot be served (vLLM answers these 500 InternalServerError)."""


@dataclass(frozen=True)
class AdapterWeights:
    """A loaded adapter: per target module, A [r, in] and scaling * B [out, r] (float32, CPU)."""

    rank: int  # the largest rank among its modules
    modules: dict[str, tuple[torch.Tensor, torch.Tensor]]


def _pattern_value(patterns: dict, module: str, default):
    """PEFT's rank_pattern / alpha_pattern lookup: the first key matching the end of the module path."""
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


def _check_config(config: dict, path: str, max_rank: int) -> None:
    problems = []
    if config.get("peft_type", "LORA") != "LORA":
        problems.append(f"peft_type is {config.get('peft_type')!r}, not 'LORA'.")
    if config.get("modules_to_save"):
        problems.append(
            f"Unsupported modules_to_save: {config['modules_to_save']} (the embedded server serves adapters "
            "of linear layers only; train without modules_to_save)."
        )
    if config.get("use_dora"):
        problems.append("DoRA is not supported (train with use_dora=False).")
    if config.get("fan_in_fan_out"):
        problems.append("fan_in_fan_out adapters (Conv1D layers) are not supported.")
    init = config.get("init_lora_weights", True)
    if isinstance(init, str) and init.lower() not in PLAIN_LORA_INITS:
        problems.append(
            f"vLLM does not support init_lora_weights={init!r}: it also changes the base model's weights. "
            "Convert it to a regular LoRA adapter with PEFT's path_initial_model_for_weight_conversion."
        )
    for key, what in (("alora_invocation_tokens", "Activated LoRA (aLoRA)"),
                      ("layer_replication", "layer_replication"),
                      ("use_bdlora", "block-diagonal LoRA (BD-LoRA)"), ("use_qalora", "QALoRA")):
        if config.get(key):
            problems.append(f"vLLM does not support {what}.")
    if config.get("target_parameters"):
        problems.append(f"target_parameters {config['target_parameters']} (LoRA on raw parameters) is not "
                        "supported.")
    ranks = [config.get("r", 8), *(config.get("rank_pattern") or {}).values()]
    if max(ranks) > max_rank:
        allowed = max_lora_ranks_for(max(ranks))
        fix = f"restart the server with --max-lora-rank {allowed[0]}" if allowed else "train a smaller rank"
        problems.append(f"LoRA rank {max(ranks)} is greater than max_lora_rank {max_rank}; {fix}.")
    if config.get("bias", "none") != "none" or config.get("lora_bias"):
        problems.append("Adapter bias is not supported (train with bias='none').")
    if problems:
        raise AdapterLoadError(f"cannot load the adapter at {path}: " + " ".join(problems))


def read_adapter(name: str, path: str, targets: dict[str, tuple[int, int]], max_rank: int) -> AdapterWeights:
    """Read and check the adapter directory `path` against the served model's LoRA targets
    (`targets`: module path -> (in_features, out_features)) and --max-lora-rank."""
    folder = Path(path).expanduser()
    config_path = folder / "adapter_config.json"
    if not config_path.is_file():
        raise AdapterNotFound(name, path)
    try:
        config = json.loads(config_path.read_text())
    except ValueError as exc:
        raise AdapterLoadError(
            f"{config_path} is not valid JSON ({exc}); write it with save_pretrained"
        ) from exc
    _check_config(config, path, max_rank)
    tensors_path = folder / "adapter_model.safetensors"
    if not tensors_path.is_file():
        raise AdapterLoadError(
            f"{path} doesn't contain tensors: the embedded server reads adapter_model.safetensors "
            "(save_pretrained's default, safe_serialization=True)"
        )
    from safetensors.torch import load_file

    try:
        tensors = load_file(str(tensors_path), device="cpu")
    except Exception as exc:  # a truncated or foreign file: say which, the caller answers 500
        raise AdapterLoadError(f"cannot read {tensors_path}: {exc}") from exc
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    unexpected = []
    for key, tensor in tensors.items():
        suffix = next((s for s in _SUFFIXES if key.endswith(s)), None)
        module = key.removeprefix(_PREFIX)[: -len(suffix)] if suffix and key.startswith(_PREFIX) else None
        if module not in targets:
            unexpected.append(module or key)
            continue
        pairs.setdefault(module, {})[suffix[6]] = tensor  # "A" or "B"
    if unexpected:
        expected = sorted({m.rsplit(".", 1)[-1] for m in targets})
        raise AdapterLoadError(
            f"While loading {path}, expected target modules in {expected} but received "
            f"{sorted(set(unexpected))}. Please verify that the loaded LoRA module is correct (the embedded "
            "server applies adapters to the linear layers of the served model's decoder)."
        )
    if not pairs:
        raise AdapterLoadError(f"{path} doesn't contain tensors")
    modules: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    rank = 0
    for module, ab in sorted(pairs.items()):
        if set(ab) != {"A", "B"}:
            raise AdapterLoadError(f"{path}: {module} has lora_{''.join(ab)} but not its pair")
        a, b = ab["A"].float(), ab["B"].float()
        in_f, out_f = targets[module]
        r = a.shape[0]
        if a.shape != (r, in_f) or b.shape != (out_f, r):
            raise AdapterLoadError(
                f"{path}: {module} has lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)}, expected "
                f"({r}, {in_f}) and ({out_f}, {r}): was the adapter trained on another model?"
            )
        if r > max_rank:
            raise AdapterLoadError(f"LoRA rank {r} of {module} is greater than max_lora_rank {max_rank}.")
        r_cfg = _pattern_value(config.get("rank_pattern") or {}, module, config.get("r", r))
        alpha = _pattern_value(config.get("alpha_pattern") or {}, module, config.get("lora_alpha", 8))
        scaling = alpha / math.sqrt(r_cfg) if config.get("use_rslora") else alpha / r_cfg
        modules[module] = (a, b * scaling)
        rank = max(rank, r)
    return AdapterWeights(rank, modules)
