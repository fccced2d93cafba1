"""`asyncgrpo.launch.EmbeddedServer` on CPU: the server it starts does not outlive the process that
launched it, and sits idle without burning CPU."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from asyncgrpo.launch import EmbeddedServer

pytestmark = pytest.mark.process

LINUX_PROC = Path("/proc/self/stat").exists()

# a launcher that starts a server, reports its pid and then waits to be killed
LAUNCHER = """
import sys, time
from asyncgrpo.launch import EmbeddedServer
server = EmbeddedServer(sys.argv[1], extra_args=["--max-model-len", "64"], log_path=sys.argv[2]).start()
print(server.process.pid, flush=True)
time.sleep(600)
"""


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """A random tiny Qwen3 without tokenizer (the server then takes token ids only)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    path = tmp_path_factory.mktemp("tiny_qwen3")
    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                         max_position_embeddings=64)
    Qwen3ForCausalLM(config).save_pretrained(path)
    return path


def _exited(pid: int) -> bool:
    """True once `pid` is gone or a zombie (exited, not yet reaped by its new parent)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    if not LINUX_PROC:
        return False
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@pytest.mark.slow
def test_server_exits_when_its_launcher_is_killed(model_dir, tmp_path):
    log = tmp_path / "server.log"
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER, str(model_dir), str(log)],
                                stdout=subprocess.PIPE, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    server_pid = None
    try:
        line = launcher.stdout.readline()  # the server answered /health
        assert line.strip().isdigit(), f"the launcher did not start a server: {line!r}\n{log.read_text()}"
        server_pid = int(line)
        assert not _exited(server_pid)
        launcher.kill()  # no chance to stop the server
        launcher.wait(timeout=10)
        deadline = time.monotonic() + 15
        while not _exited(server_pid):
            assert time.monotonic() < deadline, (f"the server outlived its launcher by 15 s:\n"
                                                 f"{log.read_text()}")
            time.sleep(0.2)
        assert "the launching process" in log.read_text()
    finally:
        launcher.kill()
        launcher.wait(timeout=10)
        if server_pid is not None and not _exited(server_pid):
            os.kill(server_pid, signal.SIGKILL)


@pytest.mark.slow
@pytest.mark.skipif(not LINUX_PROC, reason="reads the server's CPU time from /proc")
def test_idle_server_does_not_burn_cpu(model_dir, tmp_path):
    with EmbeddedServer(str(model_dir), extra_args=["--max-model-len", "64"],
                        log_path=tmp_path / "server.log") as s:
        time.sleep(1.0)  # let start-up work settle
        start_cpu, start = _cpu_seconds(s.process.pid), time.monotonic()
        time.sleep(3.0)
        share = (_cpu_seconds(s.process.pid) - start_cpu) / (time.monotonic() - start)
    assert share < 0.05, f"an idle server used {share:.0%} of a core"
