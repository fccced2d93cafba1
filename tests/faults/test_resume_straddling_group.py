"""Resume after SIGKILL trains every prompt's samples exactly once, including a group whose samples
straddle two optimizer steps at the checkpoint: its trained samples are not trained again, its untrained
ones are trained after the resume (not skipped, not regenerated)."""

from __future__ import annotations

import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
from support.scripts import script_env
from fault_helpers import MODEL, spread_reward
from train_until_straddle import NUM_PROMPTS, straddle_config

from asyncgrpo import AsyncGRPOTrainer
from asyncgrpo.tasks import arithmetic

pytestmark = pytest.mark.process

NUM_GENERATIONS = 4  # short_run_config's; one sample per single-turn rollout


class Recording(AsyncGRPOTrainer):
    def training_step(self, model, inputs, num_items_in_batch=None):
        self.trained.extend(inputs.positions)
        return super().training_step(model, inputs, num_items_in_batch)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_kill_at_a_straddling_step_then_resume_trains_every_sample_once(tmp_path, server):
    here = Path(__file__).parent
    env = script_env(here / "train_until_straddle.py")
    proc = subprocess.run(
        [sys.executable, str(here / "train_until_straddle.py"), server.url, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=400,
        env=env,
        check=False,
    )
    assert proc.returncode == -signal.SIGKILL, (
        f"never straddled (rc {proc.returncode}):\n{proc.stderr[-3000:]}"
    )
    straddling = proc.stdout.split("STRADDLING", 1)[1].split("]")[0] + "]"
    first = Counter(int(line) for line in (tmp_path / "trained_first.txt").read_text().split())
    step = proc.stdout.split("at step ")[1].split()[0]
    assert [p.name for p in (tmp_path / "out").glob("checkpoint-*")] == [f"checkpoint-{step}"] or (
        tmp_path / "out" / f"checkpoint-{step}"
    ).is_dir()

    resumed = Recording(
        model=MODEL,
        reward_funcs=spread_reward,
        train_dataset=arithmetic.make_dataset(NUM_PROMPTS, seed=2),
        args=straddle_config(tmp_path / "out", server.url),
    )
    resumed.trained = []
    resumed.train(resume_from_checkpoint=True)
    total = first + Counter(resumed.trained)
    wrong = {p: total[p] for p in range(NUM_PROMPTS) if total[p] != NUM_GENERATIONS}
    assert not wrong, (
        f"samples trained per prompt should be {NUM_GENERATIONS} exactly "
        f"(straddling at the kill: {straddling}); "
        f"got {wrong}; first run {dict(first)}, resumed run {dict(Counter(resumed.trained))}"
    )
