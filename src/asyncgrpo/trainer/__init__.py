"""TRL 1.18's stable module paths, where `AsyncGRPOTrainer` left `trl.experimental`:
`asyncgrpo.trainer.async_grpo_trainer` and `asyncgrpo.trainer.async_grpo_config` name the same objects as
`asyncgrpo.async_grpo_trainer` and `asyncgrpo.async_grpo_config` (the experimental paths), so a user of
either TRL version switches by the import line."""
