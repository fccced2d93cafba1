"""A reward function defined in the training script itself, in the three ways users launch one: a
script without `if __name__ == "__main__":`, a script read from standard input (as a notebook or the
Python prompt), and a guarded script. The rollout process is spawned and must import the script to find
the function; the first two fail at `train()` with what to do, before any process or server starts
(the trainer points at a URL where nothing listens: reaching it would mean the check came too late)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from asyncgrpo.rollout.worker import _unreported_exit

pytestmark = pytest.mark.process

SCRIPT = textwrap.dedent('''
    import os
    os.environ["HF_HUB_OFFLINE"] = "1"
    from datasets import Dataset
    from asyncgrpo import AsyncGRPOConfig, AsyncGRPOTrainer
    from asyncgrpo.tasks import arithmetic

    def my_reward(completions, **kwargs):
        return [0.0 for _ in completions]

    def main():
        trainer = AsyncGRPOTrainer(
            model="asyncgrpo/tiny-chat", reward_funcs=my_reward,
            train_dataset=Dataset.from_list(arithmetic.make_dataset(20, seed=0)),
            args=AsyncGRPOConfig(output_dir=OUT, max_steps=1, bf16=False, use_cpu=True, report_to="none",
                                 vllm_server_base_url="http://127.0.0.1:9", vllm_server_timeout=5),
        )
        try:
            trainer.train()
        except Exception as exc:
            print("RAISED", type(exc).__name__, exc, flush=True)
            raise SystemExit(3)
''')


def _run(tmp_path, body: str, from_stdin: bool) -> subprocess.CompletedProcess:
    source = SCRIPT.replace("OUT", repr(str(tmp_path / "out"))) + body
    if from_stdin:
        return subprocess.run([sys.executable, "-"], input=source,
                              capture_output=True, text=True, timeout=120, cwd=tmp_path, check=False)
    script = tmp_path / "train.py"
    script.write_text(source)
    return subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120,
                          cwd=tmp_path, check=False)


@pytest.mark.slow
@pytest.mark.timeout(150)
@pytest.mark.parametrize("case", ["unguarded script", "standard input", "guarded script"])
def test_a_reward_function_from_the_training_script_is_checked_at_train(tmp_path, case):
    guarded = case == "guarded script"
    body = '\nif __name__ == "__main__":\n    main()\n' if guarded else "\nmain()\n"
    proc = _run(tmp_path, body, from_stdin=case == "standard input")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 3, out
    raised = next(line for line in proc.stdout.splitlines() if line.startswith("RAISED"))
    if case == "unguarded script":
        assert raised.startswith("RAISED RuntimeError reward_funcs[0] (my_reward) is defined in"), raised
        assert "train.py, which has no `if __name__ == \"__main__\":` block" in raised
    elif case == "standard input":
        assert raised.startswith("RAISED TypeError reward_funcs[0] (my_reward) is defined in an "
                                 "interactive"), raised
        assert "Move my_reward into a module file" in raised
    else:  # it got past the check and on to the server, where nothing listens
        assert "127.0.0.1:9" in raised and "RuntimeError reward_funcs" not in raised, raised
    assert ("waiting for the inference server" in out if guarded
            else "waiting for the inference server" not in out)


@pytest.mark.parametrize("exitcode, words", [
    (-9, "was killed by SIGKILL (SIGKILL from nobody you know of is most often the out-of-memory killer"),
    (-15, "was killed by SIGTERM."),
    (1, "exited with code 1 before it could report an error: it failed while starting"),
])
def test_a_child_that_reported_nothing_is_described_by_how_it_ended(exitcode, words):
    assert _unreported_exit(exitcode).startswith(words)
