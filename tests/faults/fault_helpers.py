"""Short-run trainer settings and rewards of the fault tests (imported by them, not collected)."""

from __future__ import annotations

from asyncgrpo import AsyncGRPOConfig

MODEL = "asyncgrpo/tiny-chat"


def short_run_config(output_dir, url: str, **overrides) -> AsyncGRPOConfig:
    settings = {
        "output_dir": str(output_dir), "vllm_server_base_url": url, "num_generations": 4,
        "max_completion_length": 16, "learning_rate": 1e-4, "bf16": False, "use_cpu": True,
        "gradient_checkpointing": False, "save_strategy": "no", "report_to": "none", "disable_tqdm": True,
        "logging_steps": 1, "seed": 0,
    }
    return AsyncGRPOConfig(**{**settings, **overrides})


def spread_reward(completions, **kwargs) -> list[float]:
    """0, 1, 2, ... within every group: no group is ever dropped for equal rewards."""
    return [float(i) for i in range(len(completions))]
