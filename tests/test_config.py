import dataclasses
import json
import logging
import pickle
import time
import warnings

import pytest
from transformers import HfArgumentParser, TrainingArguments
from transformers.utils import is_torch_bf16_gpu_available

from asyncgrpo.config import AsyncGRPOConfig

# The seed's signature: every field AsyncGRPOConfig adds to TrainingArguments, with its default.
SEED_FIELDS = {
    "model_init_kwargs": None,
    "dtype": "float32",
    "trust_remote_code": False,
    "router_aux_loss_coef": None,
    "num_generations": 8,
    "max_completion_length": 2048,
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": 0,
    "min_p": None,
    "repetition_penalty": 1.0,
    "chat_template_kwargs": None,
    "max_tool_calling_iterations": None,
    "vllm_server_base_url": "http://localhost:8000",
    "vllm_server_timeout": 1800.0,
    "epsilon": 0.2,
    "epsilon_high": None,
    "score_centering": True,
    "vllm_importance_sampling_clip_min": 0.5,
    "vllm_importance_sampling_clip_max": 5.0,
    "num_sampler_logprobs": 8,
    "token_budget": None,
    "max_concurrent_rollouts": 512,
    "max_staleness": 4,
    "weight_sync_steps": 1,
    "rollout_worker_timeout": 300.0,
    "log_completions": False,
    "num_completions_to_print": None,
}
# fields of ours that the seed lacks (each says why in its docstring)
EXTENSION_FIELDS = {"tool_call_timeout": 300.0, "vllm_server_api_key": None,  # beyond the reference's fields
                    "keep_kv_across_syncs": False, "vllm_server_restart_timeout": 0.0,
                    "activation_memory_budget": None, "flex_attention_backend": "auto",
                    "harness_timeout": 600.0, "max_concurrent_harnesses": None, "weight_push": "full"}


def make(**kwargs):
    kwargs.setdefault("use_cpu", True)
    return AsyncGRPOConfig(**kwargs)


def test_builds_without_output_dir_with_every_seed_default():
    config = make()
    assert config.output_dir
    for name, default in {**SEED_FIELDS, **EXTENSION_FIELDS}.items():
        assert getattr(config, name) == default, name


def test_every_added_field_is_documented_in_the_docstring_and_its_help():
    base = {f.name for f in dataclasses.fields(TrainingArguments)}
    added = [f for f in dataclasses.fields(AsyncGRPOConfig) if f.name not in base]
    assert {f.name for f in added} == set(SEED_FIELDS) | set(EXTENSION_FIELDS)
    for f in dataclasses.fields(AsyncGRPOConfig):
        if f.name in SEED_FIELDS or f.name in EXTENSION_FIELDS:
            assert f.metadata.get("help"), f.name
            assert f"{f.name} (" in AsyncGRPOConfig.__doc__, f.name


def test_defaults_that_differ_from_training_arguments():
    config = make()
    assert config.logging_steps == 1
    assert config.learning_rate == 1e-6
    assert config.lr_scheduler_type == "constant"
    assert config.ignore_data_skip is True
    assert config.gradient_checkpointing is True
    assert config.report_to in ("none", [], ["none"])


def test_bf16_defaults_to_true_on_cpu_when_use_cpu_and_false_with_fp16():
    assert make().bf16 is True
    assert make(fp16=True).bf16 is False
    assert make(bf16=False).bf16 is False


@pytest.mark.skipif(is_torch_bf16_gpu_available(), reason="needs a machine without a bf16 GPU")
def test_bf16_default_falls_back_with_a_warning_when_transformers_would_refuse(caplog):
    with caplog.at_level(logging.WARNING, logger="asyncgrpo.config"):
        config = AsyncGRPOConfig()
    assert config.bf16 is False
    assert "use_cpu=True" in caplog.text


def test_explicit_gradient_checkpointing_false_is_kept():
    assert make(gradient_checkpointing=False).gradient_checkpointing is False


def test_gradient_checkpointing_is_this_configs_own_field_without_a_deprecation_warning():
    """transformers 5.2x renamed TrainingArguments.gradient_checkpointing to activation_checkpointing and
    warns for the old name; here it is the reference's field, so it only sets the new one."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        for value in (False, True):
            config = make(gradient_checkpointing=value)
            assert config.gradient_checkpointing is value
            assert getattr(config, "activation_checkpointing", value) is value


def test_an_activation_memory_budget_replaces_whole_layer_checkpointing():
    config = make(torch_compile=True, activation_memory_budget=0.5)
    assert not config.gradient_checkpointing and not getattr(config, "activation_checkpointing", False)
    assert (make(torch_compile=True).gradient_checkpointing
            or make(torch_compile=True).activation_checkpointing)


def test_ignore_data_skip_false_is_overridden_with_a_warning(caplog):
    with caplog.at_level(logging.WARNING, logger="asyncgrpo.config"):
        config = make(ignore_data_skip=False)
    assert config.ignore_data_skip is True
    assert "ignore_data_skip" in caplog.text


def test_json_string_dicts_are_parsed():
    config = make(chat_template_kwargs='{"enable_thinking": false}', model_init_kwargs='{"revision": "main"}')
    assert config.chat_template_kwargs == {"enable_thinking": False}
    assert config.model_init_kwargs == {"revision": "main"}


@pytest.mark.parametrize("value", ["{not json", "[1, 2]"])
def test_bad_json_dict_names_the_field(value):
    with pytest.raises(ValueError, match="chat_template_kwargs"):
        make(chat_template_kwargs=value)


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"deepspeed": {"zero_optimization": {"stage": 2}}}, ["deepspeed", "FSDP"]),
        ({"use_liger_kernel": True}, ["use_liger_kernel=True"]),
        ({"top_p": 0.9}, ["top_p=0.9", "top_k"]),
        ({"min_p": 0.1}, ["min_p=0.1", "top_k"]),
        ({"top_p": 0.0, "top_k": 5}, ["top_p=0.0", "(0, 1]"]),
        ({"top_p": 1.5, "top_k": 5}, ["top_p=1.5"]),
        ({"temperature": 0.0}, ["temperature=0.0", "sampling distribution"]),
        ({"num_generations": 1}, ["num_generations=1", ">= 2"]),
        ({"epsilon": 0.0}, ["epsilon=0.0"]),
        ({"epsilon": 1.2}, ["epsilon=1.2"]),
        ({"epsilon_high": -0.1}, ["epsilon_high=-0.1"]),
        ({"vllm_importance_sampling_clip_min": 1.5}, ["vllm_importance_sampling_clip_min=1.5"]),
        ({"vllm_importance_sampling_clip_max": 0.9}, ["vllm_importance_sampling_clip_max=0.9"]),
        ({"max_staleness": -1}, ["max_staleness=-1"]),
        ({"weight_sync_steps": 0}, ["weight_sync_steps=0"]),
        ({"weight_push": "sparse"}, ["weight_push='sparse'", "'delta'"]),
        ({"dtype": "fp8"}, ["dtype='fp8'"]),
        ({"top_k": -1}, ["top_k=-1"]),
        ({"max_concurrent_rollouts": 0}, ["max_concurrent_rollouts=0"]),
        ({"token_budget": 0}, ["token_budget=0"]),
        ({"vllm_server_restart_timeout": -1.0}, ["vllm_server_restart_timeout=-1.0", ">= 0"]),
        ({"activation_memory_budget": 0.5}, ["activation_memory_budget=0.5", "torch_compile=True"]),
        ({"activation_memory_budget": 1.5, "torch_compile": True},
         ["activation_memory_budget=1.5", "(0, 1]"]),
        ({"activation_memory_budget": 0.0, "torch_compile": True},
         ["activation_memory_budget=0.0", "(0, 1]"]),
        ({"flex_attention_backend": "flash", "torch_compile": False},
         ["flex_attention_backend='flash'", "torch_compile at None"]),
        ({"flex_attention_backend": "cudnn", "torch_compile": True},
         ["flex_attention_backend='cudnn'", "'triton'"]),
        ({"learning_rate": -1e-6}, ["learning_rate=-1e-06", ">= 0"]),
        ({"gradient_accumulation_steps": 0}, ["gradient_accumulation_steps=0", ">= 1"]),
        ({"vllm_server_base_url": "localhost:8000"}, ["vllm_server_base_url='localhost:8000'",
                                                      "'http://localhost:8000'"]),
        ({"vllm_server_base_url": "127.0.0.1:8000"}, ["'http://127.0.0.1:8000'"]),
        ({"vllm_server_base_url": "ftp://host:8000"}, ["vllm_server_base_url='ftp://host:8000'", "http://"]),
        ({"vllm_server_base_url": "http://"}, ["vllm_server_base_url='http://'", "host"]),
    ],
)
def test_invalid_settings_raise_naming_field_and_value(kwargs, words):
    with pytest.raises(ValueError) as info:
        make(**kwargs)
    for word in words:
        assert word in str(info.value)


@pytest.mark.parametrize("name", ["cp_size", "sp_size"])
def test_context_or_sequence_parallelism_is_rejected(name):
    from accelerate.parallelism_config import ParallelismConfig

    with pytest.raises(ValueError, match=f"parallelism_config.{name}=2"):
        make(parallelism_config=ParallelismConfig(**{name: 2}))


def test_truncated_sampling_is_accepted_with_top_k():
    config = make(top_p=0.9, top_k=20, min_p=0.05)
    assert (config.top_p, config.top_k, config.min_p) == (0.9, 20, 0.05)


def test_score_centering_without_sampler_logprobs_warns(caplog):
    with caplog.at_level(logging.WARNING, logger="asyncgrpo.config"):
        make(num_sampler_logprobs=0)
    assert "score centering does nothing" in caplog.text


def test_pickles_for_the_rollout_process():
    config = make(num_generations=4, chat_template_kwargs={"enable_thinking": False})
    clone = pickle.loads(pickle.dumps(config))
    assert clone.num_generations == 4
    assert clone.chat_template_kwargs == {"enable_thinking": False}
    assert clone.to_dict() == config.to_dict()


def test_command_line_parsing():
    (config,) = HfArgumentParser(AsyncGRPOConfig).parse_args_into_dataclasses(
        ["--use_cpu", "--num_generations", "4", "--top_k", "5", "--top_p", "0.9",
         "--chat_template_kwargs", '{"enable_thinking": false}', "--max_staleness", "0"]
    )
    assert config.num_generations == 4
    assert config.chat_template_kwargs == {"enable_thinking": False}
    assert config.max_staleness == 0


def test_construction_is_quick():
    make()  # warm caches
    start = time.perf_counter()
    for _ in range(10):
        make()
    assert (time.perf_counter() - start) / 10 < 0.5


def test_repetition_penalty_is_refused_because_it_biases_the_importance_ratios():
    with pytest.raises(ValueError, match="repetition_penalty=1.1.*importance ratio"):
        AsyncGRPOConfig(output_dir="/tmp/asyncgrpo-test-config", repetition_penalty=1.1, report_to="none")
    AsyncGRPOConfig(output_dir="/tmp/asyncgrpo-test-config", repetition_penalty=1.0, report_to="none")


def test_api_key_comes_from_vllm_api_key_when_unset_and_never_shows(monkeypatch):
    monkeypatch.setenv("VLLM_API_KEY", "from-env-7f3a")
    assert make().vllm_server_api_key == "from-env-7f3a"
    config = make(vllm_server_api_key="given-91c2")
    assert config.vllm_server_api_key == "given-91c2"
    for text in (str(config), repr(config), json.dumps(config.to_dict()), config.to_json_string()):
        assert "given-91c2" not in text and "<VLLM_SERVER_API_KEY>" in text
    # the rollout process needs it
    assert pickle.loads(pickle.dumps(config)).vllm_server_api_key == "given-91c2"
    monkeypatch.delenv("VLLM_API_KEY")
    assert make().vllm_server_api_key is None
    monkeypatch.setenv("VLLM_API_KEY", "")
    assert make().vllm_server_api_key is None


def test_train_takes_the_references_positional_arguments():
    """`train(resume_from_checkpoint, trial, ignore_keys_for_eval)`, as the specification's signature."""
    import inspect

    from asyncgrpo import AsyncGRPOTrainer

    names = list(inspect.signature(AsyncGRPOTrainer.train).parameters)
    assert names[:4] == ["self", "resume_from_checkpoint", "trial", "ignore_keys_for_eval"]


@pytest.mark.parametrize("url", ["http://localhost:8000", "https://gpu-node-3.example.com", "http://[::1]:8000/",
                                 "http://10.0.0.2:8000/v1-proxy"])
def test_server_urls_with_a_scheme_and_host_are_accepted(url):
    assert make(vllm_server_base_url=url).vllm_server_base_url == url
