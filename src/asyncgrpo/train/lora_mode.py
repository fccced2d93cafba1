"""How a PEFT run syncs its policy to the server, chosen once at start (pure).

    adapter-only   the server runs with LoRA enabled (vLLM: --enable-lora and
                   VLLM_ALLOW_RUNTIME_LORA_UPDATING=1; the embedded server: --enable-lora) and the adapter
                   is one it can serve: each sync writes the adapter and the server loads it from disk
    merged         otherwise (today's path): the adapter is merged and the full weights are pushed

The choice is made when the server is already running, so a server whose LoRA limits are too small for
the run is an error naming the flags to restart it with, not a silent fallback: --max-lora-rank must be
one of vLLM's values and at least the adapter's rank, --max-loras at least max_staleness + 2 (the
trainer keeps max_staleness + 1 versions registered and loads the next one before unloading the
oldest).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from asyncgrpo.generation.server_info import LoraServing
from asyncgrpo.modeling.lora_rules import ALLOWED_MAX_RANKS, PLAIN_LORA_INITS, max_lora_ranks_for


@dataclass(frozen=True)
class LoraSyncChoice:
    adapter_only: bool
    reason: str  # why, for the INFO line at start


def adapter_rank(peft_config: Any) -> int:
    """The largest rank among the adapter's modules (`r` and any `rank_pattern` value)."""
    return max([int(peft_config.r), *(int(r) for r in (getattr(peft_config, "rank_pattern", None) or {}).values())])


def _unservable(peft_config: Any) -> str | None:
    """Why the server cannot serve this adapter as an adapter (None: it can). vLLM 0.33 refuses the
    same features at load time (`PEFTHelper._validate_features`); routing them to merged sync here
    keeps the run going instead of failing its first sync."""
    c = peft_config
    if str(getattr(c, "peft_type", "")).rsplit(".", 1)[-1] != "LORA":
        return f"the adapter is {c.peft_type}, and servers load LoRA adapters only"
    init = getattr(c, "init_lora_weights", True)
    features = [
        (getattr(c, "use_dora", False), "DoRA adapters cannot be served as adapters"),
        (getattr(c, "modules_to_save", None), f"modules_to_save={c.modules_to_save} are full modules, not adapters"),
        (getattr(c, "trainable_token_indices", None), "trainable_token_indices (embedding rows) cannot be served"),
        (getattr(c, "bias", "none") != "none", f"bias={getattr(c, 'bias', None)!r} adapters cannot be served"),
        (getattr(c, "lora_bias", False), "lora_bias adapters cannot be served as adapters"),
        (isinstance(init, str) and init.lower() not in PLAIN_LORA_INITS,
         f"init_lora_weights={init!r} also changes the base weights, which the server does not have"),
        (getattr(c, "layer_replication", None), "layer_replication adapters cannot be served as adapters"),
        (getattr(c, "alora_invocation_tokens", None), "activated LoRA (alora_invocation_tokens) cannot be served"),
        (getattr(c, "use_qalora", False), "QALoRA adapters cannot be served as adapters"),
        (getattr(c, "use_bdlora", None), "block-diagonal LoRA (use_bdlora) cannot be served as adapters"),
        (getattr(c, "target_parameters", None), "LoRA on raw parameters (target_parameters) is not served as adapters"),
        (getattr(c, "fan_in_fan_out", False), "fan_in_fan_out adapters (Conv1D layers) cannot be served"),
    ]
    return next((why for present, why in features if present), None)


def restart_flags(rank: int, max_staleness: int, lora: LoraServing | None) -> str:
    """The server flags that serve an adapter of `rank` with `max_staleness`."""
    allowed = max_lora_ranks_for(rank)
    if not allowed:
        raise ValueError(
            f"LoRA rank {rank} is above the largest --max-lora-rank a server accepts ({ALLOWED_MAX_RANKS[-1]}): "
            f"train with r <= {ALLOWED_MAX_RANKS[-1]}"
        )
    max_rank = lora.max_lora_rank if lora is not None and lora.max_lora_rank in allowed else allowed[0]
    max_loras = max(max_staleness + 2, lora.max_loras if lora is not None else 0)
    return f"--enable-lora --max-lora-rank {max_rank} --max-loras {max_loras}"


def choose_lora_sync(
    lora: LoraServing | None, peft_config: Any, *, max_staleness: int, sharded: bool, server_url: str
) -> LoraSyncChoice:
    """Adapter-only sync when the server serves LoRA at run time and this adapter fits it, merged
    otherwise. Raises `ValueError` naming the restart flags when the server serves LoRA with limits too
    small for this run."""
    rank = adapter_rank(peft_config)
    if lora is None:
        return LoraSyncChoice(False, (
            f"the server at {server_url} runs without LoRA; restart it with {restart_flags(rank, max_staleness, None)} "
            "to sync only the adapter"
        ))
    if not lora.runtime_updating:
        return LoraSyncChoice(False, (
            f"the server at {server_url} runs with --enable-lora but without VLLM_ALLOW_RUNTIME_LORA_UPDATING=1, so "
            "it cannot load adapters at run time; restart it with that variable set to sync only the adapter"
        ))
    unservable = _unservable(peft_config)
    if unservable is not None:
        return LoraSyncChoice(False, unservable)
    if sharded:
        return LoraSyncChoice(False, "adapter-only sync of an FSDP-sharded model is not implemented")
    problems = []
    if lora.max_lora_rank not in ALLOWED_MAX_RANKS:
        problems.append(f"--max-lora-rank {lora.max_lora_rank} is not one of {', '.join(map(str, ALLOWED_MAX_RANKS))}")
    elif lora.max_lora_rank < rank:
        problems.append(f"--max-lora-rank {lora.max_lora_rank} is below the adapter's rank {rank}")
    if lora.max_loras < max_staleness + 2:
        problems.append(
            f"--max-loras {lora.max_loras} is below max_staleness + 2 = {max_staleness + 2} (the trainer keeps "
            f"max_staleness + 1 = {max_staleness + 1} adapter versions registered and loads the next one before "
            "unloading the oldest)"
        )
    if problems:
        raise ValueError(
            f"the server at {server_url} serves LoRA adapters, but {'; '.join(problems)}. Restart it with "
            f"{restart_flags(rank, max_staleness, lora)} (or lower max_staleness / the LoRA r)"
        )
    return LoraSyncChoice(True, (
        f"the server at {server_url} serves LoRA adapters (--max-lora-rank {lora.max_lora_rank}, --max-loras "
        f"{lora.max_loras}); rank {rank}, {max_staleness + 1} versions kept"
    ))
