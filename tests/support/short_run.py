"""The trainer settings of a short CPU run against the bundled tiny model, shared by the tests that train."""

from asyncgrpo import AsyncGRPOConfig


def short_run_config(output_dir, url: str, **overrides) -> AsyncGRPOConfig:
    settings = {
        "output_dir": str(output_dir), "vllm_server_base_url": url, "num_generations": 4,
        "max_completion_length": 16, "learning_rate": 1e-4, "bf16": False, "use_cpu": True,
        "gradient_checkpointing": False, "save_strategy": "no", "report_to": "none", "disable_tqdm": True,
        "logging_steps": 1, "seed": 0,
    }
    return AsyncGRPOConfig(**{**settings, **overrides})
