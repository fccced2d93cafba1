"""The LoRA rules the trainer and the embedded server share: which adapters a server can take.

The values follow vLLM 0.33, so an adapter the trainer writes for adapter-only sync loads on vLLM and
on the embedded server alike: the server checks an adapter directory against them
(`server/lora_files.py`), and the trainer checks its PEFT config before choosing adapter-only sync
and names the server flags to restart with (`train/weights/adapters.py`). Plain data and pure
functions, no torch: the CLI reads `ALLOWED_MAX_RANKS` while building `--help`.
"""

from __future__ import annotations

__all__ = ["ALLOWED_MAX_RANKS", "PLAIN_LORA_INITS", "max_lora_ranks_for"]

ALLOWED_MAX_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vLLM's MaxLoRARanks
# `init_lora_weights` strings that only set an adapter's first weights, so the saved adapter is a plain
# LoRA (vLLM 0.33 `PEFTHelper._init_is_supported`); the others (PiSSA, OLoRA, CorDA, LoftQ) also change
# the base weights, which the server does not have
PLAIN_LORA_INITS = ("gaussian", "eva", "orthogonal", "mica", "lora_ga")


def max_lora_ranks_for(rank: int) -> list[int]:
    """The `--max-lora-rank` values that serve an adapter of `rank`, smallest first (empty above the
    largest allowed value)."""
    return [r for r in ALLOWED_MAX_RANKS if r >= rank]
