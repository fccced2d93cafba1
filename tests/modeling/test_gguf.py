"""GGUF files as models (asyncgrpo.modeling.gguf): a .gguf path resolves to a model folder converted from
it once, whose weights, tokenizer and chat template are the model's the file was written from.

The GGUF files are written here (`gguf_files.write_gguf`) from a random tiny Llama and from the bundled
tiny Qwen3, so the original model is the reference: float32 tensors come back exactly, Q8_0 ones as
gguf's own dequantization of what was written.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

gguf = pytest.importorskip("gguf")

from gguf_files import TINY_CHAT, tiny_llama, write_gguf
from transformers import AutoConfig, GenerationConfig

from asyncgrpo.modeling.gguf import cache_dir, supported_architectures
from asyncgrpo.modeling.load import load_causal_lm, load_tokenizer, model_folder_problem, resolve_model_path

pytestmark = pytest.mark.process

CPU = torch.device("cpu")
TEXT = "hello world, 12+34=46 the quick brown fox <|im_end|> <think> 7"


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch) -> Path:
    """Every test converts into its own cache folder (never the user's)."""
    monkeypatch.setenv("ASYNCGRPO_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(TINY_CHAT)


@pytest.fixture(scope="module")
def llama(tokenizer):
    return tiny_llama(tokenizer)


@pytest.fixture(scope="module")
def files(tmp_path_factory, tokenizer, llama) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("gguf")
    qwen3 = load_causal_lm(TINY_CHAT, dtype=torch.float32)
    return {
        "llama": write_gguf(root / "tiny-llama-f32.gguf", llama, tokenizer),
        "llama_q8": write_gguf(root / "tiny-llama-q8_0.gguf", llama, tokenizer, qtype="Q8_0"),
        "qwen3": write_gguf(root / "tiny-chat-f32.gguf", qwen3, tokenizer),
    }


def _logits(model, tokenizer) -> torch.Tensor:
    ids = torch.tensor([tokenizer(TEXT)["input_ids"]])
    with torch.no_grad():
        return model(ids).logits


def _conversions(caplog) -> int:
    return sum("converting" in r.getMessage() for r in caplog.records if r.name == "asyncgrpo.modeling.gguf")


def test_a_llama_file_resolves_to_a_folder_with_the_written_models_exact_logits(files, llama, tokenizer):
    folder = resolve_model_path(str(files["llama"]))
    converted = load_causal_lm(folder, dtype=torch.float32)
    assert type(converted).__name__ == "LlamaForCausalLM"
    assert not converted.config.tie_word_embeddings
    # q/k rows went through llama.cpp's permutation and back
    torch.testing.assert_close(_logits(converted, tokenizer), _logits(llama, tokenizer), rtol=0, atol=1e-6)


def test_a_q8_0_file_converts_to_its_dequantized_weights(files, llama, tokenizer):
    converted = load_causal_lm(resolve_model_path(str(files["llama_q8"])), dtype=torch.float32)
    q = llama.model.layers[0].self_attn.q_proj.weight.detach()
    # Q8_0 blocks run along a row, so quantizing the permuted rows and permuting back is quantizing in place:
    # the converted weight is gguf's own dequantization of the original
    q8 = gguf.GGMLQuantizationType.Q8_0
    expected = torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(q.numpy(), q8), q8))
    got = converted.model.layers[0].self_attn.q_proj.weight.detach()
    assert not torch.equal(got, q)  # it really went through Q8_0
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    torch.testing.assert_close(_logits(converted, tokenizer), _logits(llama, tokenizer), rtol=0, atol=5e-2)


def test_the_bundled_tiny_qwen3_round_trips_with_tied_embeddings_and_its_head_dim(files, tokenizer):
    original = load_causal_lm(TINY_CHAT, dtype=torch.float32)
    converted = load_causal_lm(resolve_model_path(str(files["qwen3"])), dtype=torch.float32)
    assert converted.config.head_dim == original.config.head_dim == 32  # from attention.key_length, not 128
    assert converted.config.tie_word_embeddings
    assert converted.lm_head.weight.data_ptr() == converted.model.embed_tokens.weight.data_ptr()
    torch.testing.assert_close(_logits(converted, tokenizer), _logits(original, tokenizer), rtol=0, atol=1e-6)


def test_the_folder_has_the_tokenizer_chat_template_and_ids_of_the_file_and_no_quantization_config(
        files, tokenizer):
    folder = resolve_model_path(str(files["qwen3"]))
    # by the .gguf path, as the trainer and the server load it
    converted = load_tokenizer(str(files["qwen3"]))
    assert converted(TEXT)["input_ids"] == tokenizer(TEXT)["input_ids"]
    assert converted.chat_template == tokenizer.chat_template
    messages = [{"role": "user", "content": "What is 2+3?"}, {"role": "assistant", "content": "\\boxed{5}"}]
    assert converted.apply_chat_template(messages, tokenize=False) == tokenizer.apply_chat_template(messages,
                                                                                                    tokenize=False)
    assert (converted.eos_token, converted.pad_token) == ("<|im_end|>", "<|endoftext|>")
    config = AutoConfig.from_pretrained(folder)
    assert getattr(config, "quantization_config", None) is None
    assert "quantization_config" not in (Path(folder) / "config.json").read_text()
    generation = GenerationConfig.from_pretrained(folder)
    assert ((generation.eos_token_id, generation.pad_token_id)
            == (tokenizer.eos_token_id, tokenizer.pad_token_id))
    weights = list(Path(folder).glob("*.safetensors"))
    assert weights and all(w.stat().st_size > 0 for w in weights)


def test_a_converted_folder_is_reused_without_converting_again(files, cache, caplog):
    caplog.set_level(logging.INFO, logger="asyncgrpo.modeling.gguf")
    first = resolve_model_path(str(files["llama"]))
    assert _conversions(caplog) == 1
    stamp = (Path(first) / "config.json").stat().st_mtime_ns
    second = resolve_model_path(str(files["llama"]))
    assert second == first and _conversions(caplog) == 1
    assert any("reusing" in r.getMessage() for r in caplog.records)
    assert (Path(first) / "config.json").stat().st_mtime_ns == stamp
    assert Path(first).parent == cache / "gguf" and Path(first).name.startswith("tiny-llama-f32-")
    # no temporary left
    assert [p.name for p in (cache / "gguf").iterdir() if p.is_dir()] == [Path(first).name]


def test_a_replaced_file_is_converted_again(tmp_path, tokenizer, llama):
    path = write_gguf(tmp_path / "model.gguf", llama, tokenizer)
    first = resolve_model_path(str(path))
    os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns + 10**9))
    assert resolve_model_path(str(path)) != first


@pytest.mark.slow
def test_two_processes_asking_at_once_convert_once_into_one_folder(files, cache):
    script = textwrap.dedent("""
        import logging, sys
        logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
        from asyncgrpo.modeling.load import resolve_model_path
        print("FOLDER", resolve_model_path(sys.argv[1]))
    """)
    env = {**os.environ, "ASYNCGRPO_CACHE_DIR": str(cache), "HF_HUB_OFFLINE": "1"}
    procs = [subprocess.Popen([sys.executable, "-c", script, str(files["llama"])], env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for _ in range(2)]
    outputs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), [err[-2000:] for _, err in outputs]
    folders = {line.split(" ", 1)[1] for out, _ in outputs for line in out.splitlines()
               if line.startswith("FOLDER")}
    assert len(folders) == 1
    logs = "".join(err for _, err in outputs)
    assert logs.count(": converting this llama model") == 1, logs[-3000:]
    assert [p.name for p in (cache / "gguf").iterdir() if p.is_dir()] == [Path(folders.pop()).name]


def test_the_cache_folder_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("ASYNCGRPO_CACHE_DIR", str(tmp_path / "mine"))
    assert cache_dir() == tmp_path / "mine"
    monkeypatch.delenv("ASYNCGRPO_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "xdg" / "asyncgrpo"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_dir() == tmp_path / "home" / ".cache" / "asyncgrpo"


def test_a_gguf_path_is_not_a_folder_problem(tmp_path):
    assert model_folder_problem(str(tmp_path / "model.gguf")) is None
    assert model_folder_problem(str(tmp_path / "model.GGUF")) is None


def test_a_missing_file_raises_file_not_found(tmp_path):
    with pytest.raises(FileNotFoundError,
                       match=r"the GGUF file .*missing\.gguf does not exist; pass the path of a "
                                                r"\.gguf file or a model folder"):
        resolve_model_path(str(tmp_path / "missing.gguf"))


def test_a_file_that_is_not_gguf_says_what_it_starts_with(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_bytes(b"PK\x03\x04 a zip archive")
    with pytest.raises(ValueError,
                       match=r"model\.gguf is not a GGUF file: it starts with the bytes b'PK\\x03\\x04', "
                                         r"and a GGUF file starts with b'GGUF'; pass a \.gguf file"):
        resolve_model_path(str(path))


def test_without_the_gguf_package_the_error_names_the_extra(files, monkeypatch):
    monkeypatch.setitem(sys.modules, "gguf", None)  # `import gguf` raises ImportError
    with pytest.raises(ImportError, match=r"needs the gguf package: pip install 'asyncgrpo\[gguf\]'"):
        resolve_model_path(str(files["llama"]))


def test_an_architecture_transformers_cannot_read_is_named_with_the_supported_ones_and_the_alternatives(
        tmp_path):
    writer = gguf.GGUFWriter(tmp_path / "rwkv.gguf", "rwkv6")
    writer.add_block_count(1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError) as info:
        resolve_model_path(str(tmp_path / "rwkv.gguf"))
    message = str(info.value)
    assert "transformers cannot read GGUF files of architecture 'rwkv6'" in message
    assert "llama" in message and "qwen3" in message and "general" not in message
    assert "safetensors" in message and "vLLM" in message
    assert "llama" in supported_architectures()


def test_a_file_whose_tensors_transformers_does_not_map_is_refused_not_loaded_random(
        tmp_path, tokenizer, llama):
    writer = gguf.GGUFWriter(tmp_path / "empty.gguf", "llama")
    writer.add_context_length(64)
    writer.add_embedding_length(64)
    writer.add_block_count(1)
    writer.add_feed_forward_length(128)
    writer.add_head_count(4)
    writer.add_head_count_kv(4)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_vocab_size(len(tokenizer))
    writer.add_tensor("not_a_llama_tensor.weight", torch.ones(4).numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError,
                       match=r"transformers found no weights for \d+ parameters of this llama model"):
        resolve_model_path(str(tmp_path / "empty.gguf"))


def test_the_server_turns_gguf_errors_into_its_load_error(tmp_path):
    from asyncgrpo.server.loading import ModelLoadError, load_served_model

    with pytest.raises(ModelLoadError,
                       match=r"cannot serve '.*missing\.gguf': the GGUF file .* does not exist"):
        load_served_model(str(tmp_path / "missing.gguf"), CPU, "float32", None)


def test_the_trainer_raises_gguf_errors_before_loading(tmp_path):
    from asyncgrpo.modeling.load import load_policy

    (tmp_path / "bad.gguf").write_text("not a model")
    with pytest.raises(ValueError, match="is not a GGUF file"):
        load_policy(str(tmp_path / "bad.gguf"), dtype="float32", init_kwargs=None, trust_remote_code=False)


def test_asyncgrpo_serve_exits_2_on_a_file_that_is_not_gguf(tmp_path):
    (tmp_path / "bad.gguf").write_text("not a model")
    proc = subprocess.run([sys.executable, "-m", "asyncgrpo.cli", "serve",
                           str(tmp_path / "bad.gguf"), "--port", "0"],
                          check=False, capture_output=True, text=True, timeout=90)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "is not a GGUF file" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-2000:]
