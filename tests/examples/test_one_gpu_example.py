"""examples/one_gpu.py, the one-GPU recipe, runs as written on the bundled tiny model, a local
GSM8K-shaped file and the CPU (the recipe's hub model, hub dataset and GPU are only its defaults)."""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from pathlib import Path

import pytest

from asyncgrpo.tasks import arithmetic

pytestmark = pytest.mark.process

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def import_example(monkeypatch):
    """examples/one_gpu.py as a module."""
    monkeypatch.syspath_prepend(str(EXAMPLES))
    monkeypatch.delitem(sys.modules, "one_gpu", raising=False)  # bench/one_gpu.py has the same module name
    return importlib.import_module("one_gpu")


@pytest.fixture
def one_gpu(monkeypatch):
    return import_example(monkeypatch)


def test_gsm8k_rows_become_prompts_with_the_number_after_the_last_marker(one_gpu):
    row = {"question": "Tom has 1,200 apples and gets 34 more. How many?",
           "answer": "1,200 + 34 = <<1200+34=1234>>1234\n#### 1,234"}
    converted = one_gpu.to_prompt(row)
    assert converted["answer"] == "1234"
    assert converted["prompt"] == [{"role": "user", "content": f"{row['question']}\n\n{one_gpu.INSTRUCTION}"}]
    assert one_gpu.to_prompt(row, instruction="")["prompt"][0]["content"] == row["question"]


def write_gsm8k_file(path: Path, rows: int = 64) -> Path:
    """GSM8K-shaped rows (`question`, `answer` ending in `#### <number>`) of the tiny model's arithmetic."""
    with path.open("w") as f:
        for row in arithmetic.make_dataset(rows, seed=0):
            question = row["prompt"][-1]["content"]
            f.write(json.dumps({"question": question, "answer": f"{row['solution']}\n#### {row['answer']}"})
                    + "\n")
    return path


def test_a_local_file_is_read_as_a_json_list_or_json_lines_without_datasets(one_gpu, tmp_path):
    lines = write_gsm8k_file(tmp_path / "gsm8k.jsonl", rows=3)
    listed = tmp_path / "gsm8k.json"
    listed.write_text(json.dumps([json.loads(line) for line in lines.read_text().splitlines()]))
    from_lines = one_gpu.load_rows(argparse.Namespace(data_files=str(lines), instruction=""))
    assert from_lines == one_gpu.load_rows(argparse.Namespace(data_files=str(listed), instruction=""))
    assert len(from_lines) == 3 and from_lines[0]["prompt"][0]["role"] == "user" and from_lines[0]["answer"]


@pytest.mark.slow  # 15-25 s: the embedded server's start and two training steps on CPU
def test_the_recipe_trains_the_tiny_model_on_a_local_gsm8k_file(one_gpu, tmp_path):
    data = write_gsm8k_file(tmp_path / "gsm8k.jsonl")
    # the tiny model knows its arithmetic questions as they are, without the recipe's instruction
    history = one_gpu.main(["--model", "asyncgrpo/tiny-chat", "--data-files", str(data), "--instruction", "",
                            "--device", "cpu",
                            "--max-steps", "2", "--num-generations", "4", "--max-completion-length", "48",
                            "--token-budget", "512", "--grad-accum", "1", "--max-model-len", "256",
                            "--output-dir", str(tmp_path / "out")])
    steps = [e for e in history if "perf/step_s" in e]
    assert len(steps) == 2
    assert "rewards/accuracy_reward/mean" in steps[-1]
    assert (tmp_path / "out" / "model.safetensors").exists()  # the trained model is saved


@pytest.mark.parametrize(("flags", "words"), [
    (["--max-steps", "0"], ["--max-steps", "at least 1"]),
    (["--num-generations", "1"], ["--num-generations", "at least 2"]),
    (["--max-staleness", "-2"], ["--max-staleness", "at least 0"]),
    (["--vllm-url", "127.0.0.1:8000"], ["--vllm-url", "'http://127.0.0.1:8000'"]),
])
def test_bad_flags_exit_2_naming_the_flag_before_anything_loads(one_gpu, capsys, flags, words):
    with pytest.raises(SystemExit) as exited:
        one_gpu.main(flags)
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert all(w in err for w in words), err
