"""Tests for asyncgrpo.modeling.load and the bundled model ``asyncgrpo/tiny-chat`` (assets/tiny_chat)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import asyncgrpo
from asyncgrpo.modeling import load
from asyncgrpo.tasks import arithmetic, counter

pytestmark = pytest.mark.process

TINY = "asyncgrpo/tiny-chat"


@pytest.fixture(scope="module")
def tokenizer():
    return load.load_tokenizer(TINY)


@pytest.fixture(scope="module")
def model():
    return load.load_causal_lm(TINY)


def ids(tokenizer, messages, **kw):
    return tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True, **kw)["input_ids"]


def text(tokenizer, messages, **kw):
    return tokenizer.apply_chat_template(messages, tokenize=False, **kw)


# ------------------------------------------------------------------------------------ model resolution


def test_bundled_id_resolves_to_a_folder_inside_the_package():
    path = Path(load.resolve_model_path(TINY))
    assert path.is_dir()
    assert Path(asyncgrpo.__file__).resolve().parent in path.resolve().parents
    for name in (
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "chat_template.jinja",
        "generation_config.json",
        "eval.json",
    ):
        assert (path / name).is_file(), name


def test_local_paths_and_hub_ids_resolve_to_themselves(tmp_path):
    assert load.resolve_model_path(str(tmp_path)) == str(tmp_path)
    assert load.resolve_model_path("Qwen/Qwen3-0.6B") == "Qwen/Qwen3-0.6B"


def test_missing_bundled_files_name_the_build_script(tmp_path, monkeypatch):
    monkeypatch.setitem(load.BUNDLED_MODELS, "asyncgrpo/missing", str(tmp_path))
    with pytest.raises(FileNotFoundError, match="build_tiny_model.py"):
        load.resolve_model_path("asyncgrpo/missing")


def test_bundled_model_loads_offline_in_a_fresh_process():
    code = (
        "from asyncgrpo.modeling.load import load_causal_lm, load_tokenizer\n"
        "tok = load_tokenizer('asyncgrpo/tiny-chat'); m = load_causal_lm('asyncgrpo/tiny-chat')\n"
        "x = tok.apply_chat_template([{'role': 'user', 'content': 'What is 2 + 3?'}],"
        " add_generation_prompt=True, return_tensors='pt', return_dict=True)\n"
        "out = m.generate(**x, max_new_tokens=4, do_sample=False)\n"
        "print(type(m).__name__, out.shape[1] > x['input_ids'].shape[1])\n"
    )
    # An unroutable proxy makes any network attempt fail fast instead of silently succeeding.
    env = dict(
        os.environ,
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        HTTPS_PROXY="http://127.0.0.1:9",
        HTTP_PROXY="http://127.0.0.1:9",
    )
    result = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120, check=False
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().endswith("Qwen3ForCausalLM True")


def test_asset_folder_is_at_most_20_mb():
    folder = Path(load.resolve_model_path(TINY))
    size = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())
    assert size <= 20 * 2**20, f"{size / 2**20:.1f} MB"


# ------------------------------------------------------------------------------------- model + config


def test_model_is_a_small_qwen3_matching_its_tokenizer(model, tokenizer):
    num_params = sum(p.numel() for p in model.parameters())
    print(f"tiny-chat parameters: {num_params}")
    assert type(model).__name__ == "Qwen3ForCausalLM"
    assert 100_000 < num_params < 5_000_000
    assert model.config.vocab_size == len(tokenizer)
    assert model.config.num_key_value_heads < model.config.num_attention_heads  # GQA
    assert model.dtype == torch.float32


def test_generation_config_stops_at_im_end_and_samples_plainly(model, tokenizer):
    gen = model.generation_config
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert gen.eos_token_id == im_end == tokenizer.eos_token_id
    assert gen.pad_token_id == tokenizer.convert_tokens_to_ids("<|endoftext|>") == tokenizer.pad_token_id
    assert gen.do_sample is True and gen.temperature == 1.0 and gen.top_p == 1.0
    assert not gen.top_k  # no top-k truncation by default


def test_eval_report_is_inside_the_calibration_band():
    report = json.loads((Path(load.resolve_model_path(TINY)) / "eval.json").read_text())
    assert report["num_eval_per_task"] >= 200
    assert 0.2 <= report["arithmetic_success_rate"] <= 0.7
    assert 0.2 <= report["counter_success_rate"] <= 0.7


def test_greedy_answers_follow_the_trained_formats(model, tokenizer):
    row = arithmetic.make_row(12, "+", 5)
    x = tokenizer.apply_chat_template(
        row["prompt"], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    out = model.generate(**x, max_new_tokens=40, do_sample=False)
    answer = tokenizer.decode(out[0, x["input_ids"].shape[1] :], skip_special_tokens=True)
    assert arithmetic.extract_boxed(answer) is not None, answer

    row = counter.make_row(7, 3)
    x = tokenizer.apply_chat_template(
        row["prompt"],
        tools=[counter.IncrementEnv().increment],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    out = model.generate(**x, max_new_tokens=30, do_sample=False)
    answer = tokenizer.decode(out[0, x["input_ids"].shape[1] :], skip_special_tokens=True)
    assert answer.startswith('<tool_call>\n{"name": "increment", "arguments": {"step": '), answer


# ----------------------------------------------------------------------------------------- tokenizer


def test_special_tokens_and_roles(tokenizer):
    assert tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.pad_token == "<|endoftext|>"
    for token in [
        "<|im_start|>",
        "<|im_end|>",
        "<|endoftext|>",
        "<think>",
        "</think>",
        "<tool_call>",
        "</tool_call>",
        "<tool_response>",
        "</tool_response>",
    ]:
        (token_id,) = tokenizer.encode(token, add_special_tokens=False)
        assert tokenizer.convert_ids_to_tokens(token_id) == token


def test_digits_are_single_tokens(tokenizer):
    pieces = tokenizer.convert_ids_to_tokens(tokenizer.encode("12345 + 907", add_special_tokens=False))
    digits = [p for p in pieces if any(c.isdigit() for c in p)]
    assert digits == list("12345907")


def test_tool_call_tags_survive_decoding_without_special_tokens(tokenizer):
    s = '<think>\nhm\n</think>\n\n<tool_call>\n{"name": "increment", "arguments": {"step": 2}}\n</tool_call>'
    token_ids = tokenizer.encode(s + "<|im_end|>", add_special_tokens=False)
    assert tokenizer.decode(token_ids, skip_special_tokens=True) == s
    assert (
        tokenizer.decode(tokenizer.encode("any text: h\u00e9llo", add_special_tokens=False))
        == "any text: h\u00e9llo"
    )


# ------------------------------------------------------------------------------------- chat template


def tool_conversation(with_thinking: bool) -> list[dict]:
    """A two-call counter conversation with a system prompt, optionally with reasoning content."""
    msgs = [{"role": "system", "content": "You are terse."}] + counter.make_row(7, 4)["prompt"]
    for i, m in enumerate(counter.reference_messages(7, 4)):
        m = dict(m)
        if with_thinking and m["role"] == "assistant":
            m["reasoning_content"] = f"step {i}: think"
        msgs.append(m)
    msgs += [
        {"role": "user", "content": "Thanks. What is 2 + 2?"},
        {"role": "assistant", "content": "2 + 2 = 4. \\boxed{4}"},
    ]
    return msgs


def test_template_renders_tool_schemas_calls_and_responses(tokenizer):
    tools = [counter.IncrementEnv().increment]
    rendered = text(tokenizer, tool_conversation(False), tools=tools)
    schema = json.dumps(counter_schema())
    assert rendered.startswith("<|im_start|>system\nYou are terse.\n\n# Tools\n")
    assert f"<tools>\n{schema}\n</tools>" in rendered
    assert (
        '<|im_start|>assistant\n<tool_call>\n{"name": "increment", "arguments": {"step": 4}}\n'
        "</tool_call><|im_end|>\n"
    ) in rendered
    assert "<|im_start|>user\n<tool_response>\n4\n</tool_response><|im_end|>\n" in rendered
    assert "<|im_start|>user\n<tool_response>\n7\n</tool_response><|im_end|>\n" in rendered
    assert rendered.count("<|im_start|>system") == 1
    # passing the schema dict renders exactly like passing the method
    assert rendered == text(tokenizer, tool_conversation(False), tools=[counter_schema()])


def counter_schema() -> dict:
    from transformers.utils import get_json_schema

    return get_json_schema(counter.IncrementEnv().increment)


def test_template_renders_content_and_tool_calls_together(tokenizer):
    call = {"type": "function", "function": {"name": "increment", "arguments": '{"step": 1}'}}
    msgs = [
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": "Calling.", "tool_calls": [call, call]},
    ]
    assert text(tokenizer, msgs).endswith(
        '<|im_start|>assistant\nCalling.\n<tool_call>\n{"name": "increment", "arguments": {"step": 1}}\n'
        '</tool_call>\n<tool_call>\n{"name": "increment", "arguments": {"step": 1}}\n</tool_call><|im_end|>\n'
    )


def test_generation_prompt_and_enable_thinking(tokenizer):
    msgs = [{"role": "user", "content": "What is 2 + 3?"}]
    prompt = text(tokenizer, msgs, add_generation_prompt=True)
    assert prompt == "<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n<|im_start|>assistant\n"
    for flag in (True, False):
        assert text(tokenizer, msgs, add_generation_prompt=True, enable_thinking=flag) == prompt


@pytest.mark.parametrize("with_thinking", [False, True])
def test_template_is_prefix_preserving_over_a_tool_conversation(tokenizer, with_thinking):
    tools = [counter.IncrementEnv().increment]
    msgs = tool_conversation(with_thinking)
    full = ids(tokenizer, msgs, tools=tools)
    for k in range(1, len(msgs)):
        shorter = ids(tokenizer, msgs[:k], tools=tools)
        longer = ids(tokenizer, msgs[: k + 1], tools=tools)
        assert longer[: len(shorter)] == shorter, f"messages[:{k}] is not a prefix of messages[:{k + 1}]"
        if msgs[k]["role"] == "assistant":  # what a multi-turn rollout generates from
            prompt = ids(tokenizer, msgs[:k], tools=tools, add_generation_prompt=True)
            assert longer[: len(prompt)] == prompt
        assert full[: len(longer)] == longer
    rendered = tokenizer.decode(full)
    if with_thinking:  # earlier reasoning is kept, not dropped as in Qwen3's official template
        assert rendered.count("<think>\nstep ") == 3
        assert "<|im_start|>assistant\n<think>\nstep 0: think\n</think>\n\n<tool_call>" in rendered
    else:
        assert "<think>" not in rendered


# ----------------------------------------------------------------------------------- build script data


def _build_script():
    import importlib.util

    path = Path(__file__).resolve().parents[2] / "scripts" / "build_tiny_model.py"
    spec = importlib.util.spec_from_file_location("build_tiny_model", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_build_data_leaves_a_share_of_arithmetic_answers_unboxed():
    build = _build_script()
    cfg = build.BuildConfig()
    arith = arithmetic.make_dataset(2000, seed=5)
    count = counter.make_dataset(50, seed=6)
    conversations = build.training_conversations(arith, count, cfg)
    assert len(conversations) == 2050
    answers = [c[-1]["content"] for c in conversations[:2000]]
    unboxed = [a for a in answers if arithmetic.extract_boxed(a) is None]
    assert abs(len(unboxed) / 2000 - cfg.unboxed_frac) < 0.04
    for row, answer in zip(arith, answers):  # unboxed answers are the same chain, stopped before the box
        assert answer == row["solution"] or (row["solution"].startswith(answer) and answer.endswith("."))
    # counter conversations: the reference calls, or (overshoot) max_step every call, past the target
    overshot = 0
    for row, conversation in zip(count, conversations[2000:]):
        reference = counter.reference_messages(row["target"], row["max_step"])
        if conversation[1:] == reference:
            continue
        steps = [m["tool_calls"][0]["function"]["arguments"]["step"]
                 for m in conversation if m.get("tool_calls")]
        assert set(steps) == {row["max_step"]} and sum(steps) > row["target"], conversation
        assert conversation[-1]["content"] == counter.final_message(sum(steps))
        overshot += 1
    assert 0 < overshot < len(count)
    assert build.training_conversations(arith, count, cfg) == conversations  # seeded


@pytest.mark.parametrize("make_folder", [False, True])
def test_a_local_model_path_without_a_model_is_refused_naming_what_to_pass(tmp_path, make_folder):
    from asyncgrpo.modeling.load import load_policy

    path = tmp_path / "checkpoint"
    if make_folder:
        path.mkdir()
    what = "has no config.json" if make_folder else "does not exist"
    with pytest.raises(FileNotFoundError) as info:
        load_policy(str(path), dtype="float32", init_kwargs=None, trust_remote_code=False)
    message = str(info.value)
    assert str(path) in message and what in message and "save_pretrained" in message, message
    assert load.model_folder_problem(str(path)) is not None
    assert load.model_folder_problem("Qwen/Qwen3-0.6B") is None  # a hub id is the hub's to resolve
    assert load.model_folder_problem(load.resolve_model_path("asyncgrpo/tiny-chat")) is None
