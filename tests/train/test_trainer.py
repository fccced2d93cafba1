"""AsyncGRPOTrainer end to end against a real embedded server (CPU, bundled tiny model)."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from datasets import Dataset

from asyncgrpo import AsyncGRPOConfig, AsyncGRPOTrainer, AsyncRolloutLoop
from asyncgrpo.rewards import accuracy_reward
from asyncgrpo.tasks import arithmetic

pytestmark = pytest.mark.process

os.environ.setdefault("HF_HUB_OFFLINE", "1")
MODEL = "asyncgrpo/tiny-chat"


@pytest.fixture
def server(embedded_server):
    """The pool's plain server for tests that push weights (tests/train/test_multiprocess.py shares it)."""
    return embedded_server(MODEL, purpose="trained")


def _config(tmp_path, server, cls=AsyncGRPOConfig, **overrides) -> AsyncGRPOConfig:
    kwargs = {
        "output_dir": str(tmp_path / "out"),
        "vllm_server_base_url": server.url,
        "num_generations": 4,
        "max_completion_length": 32,
        "learning_rate": 1e-4,
        "bf16": False,
        "use_cpu": True,
        "gradient_checkpointing": False,
        "save_strategy": "no",
        "report_to": "none",
        "disable_tqdm": True,
        "logging_steps": 1,
        "seed": 0,
        "token_budget": 256,  # rows of a few groups: a step waits for less generation
    }
    kwargs.update(overrides)
    return cls(**kwargs)


def _dataset(n: int, seed: int = 0) -> Dataset:
    return Dataset.from_list(arithmetic.make_dataset(n, seed=seed))


def _logged(trainer) -> list[dict]:
    return [entry for entry in trainer.state.log_history if "loss" in entry]


def test_short_run_updates_parameters_and_logs_the_seed_metrics(tmp_path, server):
    trainer = AsyncGRPOTrainer(
        model=MODEL, reward_funcs=accuracy_reward, train_dataset=_dataset(64),
        args=_config(tmp_path, server, max_steps=3, report_to="tensorboard"),
    )
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    changed = [n for n, p in trainer.model.named_parameters() if not torch.equal(before[n], p.detach())]
    assert changed, "no parameter moved after 3 optimizer steps"
    logs = _logged(trainer)
    assert len(logs) == 3
    keys = set().union(*logs)
    for name in (
        "loss", "reward", "num_tokens", "entropy",
        "sampling/importance_sampling_ratio/mean", "sampling/sampling_logp_difference/max",
        "sampling/masked_mean", "clip_ratio/region_mean", "batch/packing_ratio", "batch/samples_per_row",
        "batch/trained_tokens_per_step",
        "perf/step_s", "perf/fwd_bwd_s", "perf/weight_sync_s", "perf/rollout_wait_s",
        "sample/staleness_max", "rollout/generated_tokens_per_s", "completions/mean_length",
    ):
        assert name in keys, f"{name} missing from the logged metrics: {sorted(keys)}"
    # num_tokens is cumulative, per-step sizes are not
    assert logs[-1]["num_tokens"] > logs[0]["num_tokens"]
    # a group is one prompt's rollouts: prompts share their tokens, packing must show it
    assert max(entry["batch/packing_ratio"] for entry in logs) > 1.0
    # report_to=tensorboard received the same scalars
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    runs = [root for root, _, files in os.walk(tmp_path / "out")
            if any(f.startswith("events.") for f in files)]
    assert runs, "no tensorboard event file written"
    events = EventAccumulator(runs[0])
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"train/reward", "train/loss", "train/batch/packing_ratio"} <= tags, sorted(tags)


@pytest.mark.slow
def test_one_epoch_stops_after_every_prompt_is_trained(tmp_path, server):
    dataset = _dataset(6, seed=3)
    trainer = AsyncGRPOTrainer(
        model=MODEL, reward_funcs=accuracy_reward, train_dataset=dataset,
        args=_config(tmp_path, server, num_train_epochs=1),
    )
    trainer.train()
    assert trainer.last_trained_position == len(dataset)


def raising_reward(completions, **kwargs):
    raise ValueError("reward exploded on purpose")


@pytest.mark.slow
def test_raising_reward_fails_fast_with_its_traceback(tmp_path, server):
    trainer = AsyncGRPOTrainer(
        model=MODEL, reward_funcs=raising_reward, train_dataset=_dataset(16),
        args=_config(tmp_path, server, max_steps=2)
    )
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="reward exploded on purpose") as info:
        trainer.train()
    assert time.monotonic() - t0 < 60
    assert "raising_reward" in str(info.value)  # the child's traceback names the function


@pytest.mark.slow
def test_the_dtype_warning_compares_the_precision_of_the_trainers_matmuls(tmp_path, server, caplog):
    """float32 weights under bf16 autocast multiply in bfloat16: against this float32 server that is the
    mismatch to report (not the weights' float32, which matches it)."""
    trainer = AsyncGRPOTrainer(model=MODEL, reward_funcs=accuracy_reward, train_dataset=_dataset(16),
                               args=_config(tmp_path, server, max_steps=1, bf16=True))
    assert next(trainer.model.parameters()).dtype == torch.float32
    with caplog.at_level("WARNING", logger="asyncgrpo.train.serving"):
        trainer.train()
    assert "the server runs in float32 and the trainer in bfloat16" in caplog.text
    assert "--dtype bfloat16" in caplog.text


def test_lambda_reward_is_refused_at_train(tmp_path, server):
    trainer = AsyncGRPOTrainer(
        model=MODEL, reward_funcs=lambda completions, **kw: [0.0] * len(completions),
        train_dataset=_dataset(8), args=_config(tmp_path, server, max_steps=1),
    )
    with pytest.raises(TypeError, match="lambda"):
        trainer.train()


def test_plain_text_prompts_are_refused_up_front(tmp_path, server):
    dataset = Dataset.from_list([{"prompt": "What is 1 + 1?", "answer": "2"}])
    with pytest.raises(ValueError, match="conversational"):
        AsyncGRPOTrainer(model=MODEL, reward_funcs=accuracy_reward, train_dataset=dataset,
                         args=_config(tmp_path, server, max_steps=1))


def test_flash_attention_on_a_cpu_trainer_is_refused_at_init_with_the_fix(tmp_path, server):
    with pytest.raises(ValueError, match="trains on cpu: set flex_attention_backend='triton'"):
        AsyncGRPOTrainer(model=MODEL, reward_funcs=accuracy_reward, train_dataset=_dataset(8),
                         args=_config(tmp_path, server, max_steps=1, torch_compile=True,
                                      flex_attention_backend="flash"))


def constant_reward_for_even_rows(completions, answer, **kwargs):
    """1/0 accuracy on odd answers, a constant on even ones: the even groups have zero std."""
    scores = accuracy_reward(completions, answer=answer)
    return [1.0 if int(a) % 2 == 0 else s for a, s in zip(answer, scores)]


@pytest.mark.slow
def test_zero_std_groups_are_dropped_and_counted(tmp_path, server):
    trainer = AsyncGRPOTrainer(
        model=MODEL, reward_funcs=constant_reward_for_even_rows, train_dataset=_dataset(24, seed=5),
        # 3 steps: enough groups are read that some of the even (zero-std) ones are among them
        args=_config(tmp_path, server, max_steps=3),
    )
    trainer.train()
    logs = _logged(trainer)
    assert any(entry.get("frac_reward_zero_std", 0.0) > 0.0 for entry in logs)


class SlowTrainer(AsyncGRPOTrainer):
    """Sleeps in every step so that queued samples fall `max_staleness` versions behind."""

    def training_step(self, model, inputs, num_items_in_batch=None):
        time.sleep(1.5)
        return super().training_step(model, inputs, num_items_in_batch)


@pytest.mark.slow
def test_stale_samples_are_dropped_under_a_slow_trainer(tmp_path, server):
    trainer = SlowTrainer(
        model=MODEL, reward_funcs=accuracy_reward, train_dataset=_dataset(64, seed=7),
        # a row holds one or two samples while a group brings four: a group's last samples wait
        # several weight versions in the queue
        args=_config(tmp_path, server, max_steps=6, max_staleness=1, token_budget=64),
    )
    trainer.train()
    logs = _logged(trainer)
    assert sum(entry.get("sample/dropped_stale_count", 0) for entry in logs) > 0
    assert max(entry["sample/staleness_max"] for entry in logs) >= 1


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_on_policy_training_with_gradient_accumulation_and_sparse_syncs(tmp_path, server):
    """max_staleness=0 while the weight version lags the steps: two micro-batches per step and a sync
    every second step. The rollout process's quota of a version runs out before the trainer has all
    it needs under that version; the trainer raises it instead of both sides waiting forever."""
    trainer = AsyncGRPOTrainer(
        model=MODEL, reward_funcs=accuracy_reward, train_dataset=_dataset(64, seed=3),
        args=_config(tmp_path, server, max_steps=4, max_staleness=0, gradient_accumulation_steps=2,
                     weight_sync_steps=2),
    )
    trainer.train()
    logs = _logged(trainer)
    assert trainer.state.global_step == 4 and len(logs) == 4
    assert all(entry["sample/staleness_max"] == 0 for entry in logs)
    assert sum(entry.get("sample/dropped_stale_count", 0) for entry in logs) == 0
    assert all(entry["batch/microbatches_per_step"] == 2 for entry in logs)


# --- the seed's CurriculumRolloutLoop example, unchanged apart from the import line ---------------


@dataclass
class CurriculumConfig(AsyncGRPOConfig):
    pass_rate_cap: float = 0.9


class CurriculumRolloutLoop(AsyncRolloutLoop):
    def filter_prompt(self, row_index, row, epoch):
        return self.pass_rates.get(row_index, 0.0) < self.config.pass_rate_cap

    async def setup(self):
        self.pass_rates = {}

    def compute_advantages(self, group):
        scored = group.rewards[~np.isnan(group.rewards)]
        if len(scored):
            self.pass_rates[group.row_index] = float(np.mean(scored > 0))
        return super().compute_advantages(group)


class CurriculumTrainer(AsyncGRPOTrainer):
    loop_cls = CurriculumRolloutLoop


@pytest.mark.slow
def test_seed_curriculum_loop_runs_unchanged(tmp_path, server):
    config = _config(tmp_path, server, cls=CurriculumConfig, max_steps=2, pass_rate_cap=0.5)
    trainer = CurriculumTrainer(model=MODEL, reward_funcs=accuracy_reward,
                                train_dataset=_dataset(32), args=config)
    trainer.train()
    assert trainer.state.global_step == 2


@pytest.mark.slow
def test_torch_compile_compiles_each_decoder_layer_not_the_whole_model(tmp_path, server):
    """torch_compile=True: the layers are compiled in place (parameter names unchanged for the weight
    sync), accelerate leaves the model itself alone, and training runs (aot_eager: no code generation).
    With activation_memory_budget the partitioner gets the budget and the Trainer does not wrap the
    layers in whole-layer checkpointing, even where gradient_checkpointing=True asks for it."""
    import torch._functorch.config

    # the process-wide value comes back after
    with torch._functorch.config.patch(activation_memory_budget=1.0):
        trainer = AsyncGRPOTrainer(
            model=MODEL, reward_funcs=accuracy_reward, train_dataset=_dataset(16),
            args=_config(tmp_path, server, max_steps=2, torch_compile=True, torch_compile_backend="aot_eager",
                         gradient_checkpointing=True, activation_memory_budget=0.5),
        )
        names = [n for n, _ in trainer.model.named_parameters()]
        trainer.train()
        assert not trainer.model.is_gradient_checkpointing
        assert torch._functorch.config.activation_memory_budget == 0.5
    assert all(layer._compiled_call_impl is not None for layer in trainer.model.model.layers)
    assert [n for n, _ in trainer.model_wrapped.named_parameters()] == names
    assert len(_logged(trainer)) == 2
