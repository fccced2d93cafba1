"""`asyncgrpo demo` end to end, shortened: embedded server, held-out evaluation, training, outputs."""

import json
import os
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.process, pytest.mark.timeout(300)]


@pytest.mark.slow
def test_demo_trains_and_writes_accuracy_metrics_and_plot(tmp_path):
    out = tmp_path / "demo"
    cmd = [sys.executable, "-m", "asyncgrpo.cli", "demo", "--output-dir", str(out), "--max-steps", "2",
           "--num-train-prompts", "64", "--num-eval-prompts", "8", "--eval-samples", "1", "--eval-every", "1"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    run = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=280, env=env)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "held-out accuracy before training:" in run.stdout
    assert "held-out accuracy:" in run.stdout and "answers boxed:" in run.stdout

    result = json.loads((out / "accuracy.json").read_text())
    assert result["steps"] == 2 and result["eval_prompts"] == 8
    for key in ("accuracy_before", "accuracy_after", "boxed_before", "boxed_after"):
        assert 0.0 <= result[key] <= 1.0, (key, result)
    # 8 questions x 1 sample: every rate is a multiple of 1/8
    assert (result["accuracy_before"] * 8) % 1 == 0 and (result["boxed_after"] * 8) % 1 == 0

    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    trained = [r for r in records if "loss" in r and "train_loss" not in r]
    assert [r["step"] for r in trained] == [1, 2]
    assert "reward" in trained[0]  # rollout metrics come with the steps that saw new rollouts
    evaluations = [r for r in records if "heldout_accuracy" in r]
    assert [r["step"] for r in evaluations] == [0, 1, 2]  # before, every step (eval_every=1), after
    assert all(0.0 <= r["heldout_boxed"] <= 1.0 for r in evaluations)
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert "no plot" in run.stdout
    else:
        assert (out / "reward_accuracy.png").stat().st_size > 0


@pytest.mark.parametrize(("flags", "words"), [
    (["--max-steps", "0"], ["--max-steps", "at least 1", "got 0"]),
    (["--num-train-prompts", "0"], ["--num-train-prompts", "at least 1"]),
    (["--num-eval-prompts", "-3"], ["--num-eval-prompts", "at least 1"]),
    (["--eval-samples", "0"], ["--eval-samples", "at least 1"]),
    (["--num-generations", "1"], ["--num-generations", "at least 2"]),
    (["--eval-every", "-1"], ["--eval-every", "at least 0"]),
    (["--max-staleness", "-1"], ["--max-staleness", "at least 0"]),
    (["--learning-rate", "-0.1"], ["--learning-rate", "at least 0"]),
    (["--server-url", "localhost:8000"], ["--server-url", "'http://localhost:8000'"]),
])
def test_bad_demo_flags_exit_2_naming_the_flag_before_anything_starts(tmp_path, capsys, flags, words):
    from asyncgrpo.cli import main

    with pytest.raises(SystemExit) as exited:  # argparse's exit: a usage line and the error, no traceback
        main(["demo", "--output-dir", str(tmp_path / "demo"), *flags])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert all(w in err for w in words), err
    assert not (tmp_path / "demo").exists()
