"""Malformed or absurd requests and flags get a 400 (or a clear start-up error), never a 500."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest
from fault_helpers import TINY, call

pytestmark = pytest.mark.process

DEEP = 100_000


@pytest.mark.parametrize("prompt", ["", ["", "hello"], ["hello", ""]])
def test_empty_text_prompt_is_400_alone_and_in_a_batch(tiny_server, prompt):
    status, body = call(tiny_server.url, "POST", "/v1/completions", {"prompt": prompt, "max_tokens": 2})
    assert status == 400, body
    assert body["error"]["param"] == "prompt" and "empty" in body["error"]["message"]


@pytest.mark.parametrize("raw", [
    b'{"prompt": "hi", "max_tokens": ' + b"9" * 5000 + b"}",  # beyond Python's int parsing limit
    b'{"prompt": "hi", "temperature": 1' + b"0" * 399 + b"}",  # beyond float range
    b'{"prompt": "hi", "max_tokens": 1' + b"0" * 30 + b"}",  # beyond int64
    b'{"prompt": "hi", "seed": -1' + b"0" * 30 + b"}",
    b'{"prompt": "hi", "x": ' + b"[" * DEEP + b"]" * DEEP + b"}",
    b'{"prompt": "hi", "stream_options": "x"}',
])
def test_absurd_values_are_400_on_completions(tiny_server, raw):
    status, body = call(tiny_server.url, "POST", "/v1/completions", raw)
    assert status == 400, body
    assert body["error"]["type"] == "BadRequestError" and len(body["error"]["message"]) < 500


@pytest.mark.parametrize("extra", [{"stream": True, "stream_options": "x"}, {"stream_options": ["x"]},
                                   {"sampling_params": {"temperature": 10**400}}])
def test_absurd_values_are_400_on_generate(tiny_server, extra):
    body = {"token_ids": [1, 2, 3], "sampling_params": {"max_tokens": 2}, **extra}
    status, out = call(tiny_server.url, "POST", "/inference/v1/generate", body)
    assert status == 400, out


def test_server_still_serves_after_bad_requests(tiny_server):
    status, body = call(tiny_server.url, "POST", "/v1/completions",
                        {"prompt": "hello", "max_tokens": 2, "stream_options": {"include_usage": True}})
    assert status == 200 and body["usage"]["completion_tokens"] >= 1


def _serve(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "asyncgrpo.cli", "serve", *args, "--port", "0"],
                          check=False, capture_output=True, text=True, timeout=90)


@pytest.mark.parametrize("args,words", [
    ((TINY, "--max-model-len", "0"), ["--max-model-len 0", "positive"]),
    (("/nonexistent/model/dir",), ["/nonexistent/model/dir", "does not exist", "config.json"]),
    (("nonexistent-org/no-such-model",), ["nonexistent-org/no-such-model", "hub"]),
])
@pytest.mark.slow
def test_bad_serve_flags_exit_2_with_a_message_and_no_traceback(args, words):
    proc = _serve(*args)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert all(w in proc.stderr for w in words), proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr


@pytest.mark.slow
def test_a_port_another_process_listens_on_exits_2_before_loading_the_model():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = subprocess.run([sys.executable, "-m", "asyncgrpo.cli", "serve", TINY, "--port", str(port)],
                              check=False, capture_output=True, text=True, timeout=90)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert f"cannot listen on 127.0.0.1:{port}: another process already does" in proc.stderr
    assert "pass another --port" in proc.stderr and "Traceback" not in proc.stderr
    assert "self-check" not in proc.stderr.lower()  # refused before the model loaded


def test_a_port_out_of_range_exits_2_naming_the_range():
    proc = subprocess.run([sys.executable, "-m", "asyncgrpo.cli", "serve", TINY, "--port", "99999"],
                          check=False, capture_output=True, text=True, timeout=90)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "--port" in proc.stderr and "0 to 65535" in proc.stderr and "99999" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.slow
def test_a_host_address_this_machine_lacks_exits_2_before_loading_the_model():
    # 192.0.2.1 is reserved for documentation (RFC 5737): no machine's interface has it
    proc = subprocess.run([sys.executable, "-m", "asyncgrpo.cli", "serve", TINY, "--host", "192.0.2.1"],
                          check=False, capture_output=True, text=True, timeout=90)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "cannot listen on 192.0.2.1:8000" in proc.stderr and "--host" in proc.stderr, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    assert "self-check" not in proc.stderr.lower()  # refused before the model loaded


@pytest.mark.parametrize(("flags", "words"), [
    (["--max-num-seqs", "0"], ["--max-num-seqs", "at least 1"]),
    (["--max-num-batched-tokens", "0"], ["--max-num-batched-tokens", "at least 1"]),
    (["--max-logprobs", "-1"], ["--max-logprobs", "at least 0"]),
    (["--trainer-lease", "-1"], ["--trainer-lease", "at least 0"]),
    (["--weight-transfer-timeout", "0"], ["--weight-transfer-timeout", "more than 0"]),
    (["--admission-interval", "0"], ["--admission-interval", "at least 1"]),
])
def test_serve_flags_out_of_range_exit_2_naming_the_flag(capsys, flags, words):
    from asyncgrpo.cli import serve_arguments

    with pytest.raises(SystemExit) as exited:
        serve_arguments(TINY, *flags)
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert all(w in err for w in words), err
