"""What every test shares: the cost tiers and the pool of embedded servers. pytest puts this folder on
sys.path (prepend imports), so `support`, the helpers several test folders share, imports from every test.

Tiers (markers registered in pyproject.toml; docs/developing.md says what each costs):

    unit     no child process and no model: pure functions, small tensors, files     pytest -m unit
    engine   a model in this process: a tiny model's forward, the server's scheduler
             and runner, a ServerThread-free engine                                     pytest -m engine
    process  child processes: embedded servers, trainers (each spawns its rollout
             process), torchrun, CLI runs                                               pytest -m process

A module says `pytestmark = pytest.mark.engine` (or `process`), or a test carries the marker; a test
that uses the server pool is `process` whatever its module says; every other CPU test is `unit`. A test
has one tier: `engine` beside `process` is a collection error. A `unit` or `engine` test that starts a
child process fails at teardown, naming the command, so the tiers cannot drift.

The pool (`embedded_server`) starts one embedded server per distinct (model, flags, env, purpose) and
keeps it for the session: tests that only read a server share it. A test that changes a server's state
for good (weight pushes, adapters) passes a `purpose` of its own, so that only tests of that purpose see
the state it leaves; a test that changes state and restores it (a weight version put back) may share.
"""

from __future__ import annotations

import multiprocessing.process
import os
import subprocess
from collections import OrderedDict
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

TIERS = ("unit", "engine", "process")
TINY = "asyncgrpo/tiny-chat"


# -- process accounting: every child this pytest process starts --------------------------------------


class _Children:
    """Counts the child processes started in this process, and what the test running now started."""

    def __init__(self) -> None:
        self.num_processes = 0
        self.num_servers = 0
        self.current: list[str] = []  # what the running test started

    def record(self, what: str, is_server: bool) -> None:
        self.num_processes += 1
        self.num_servers += is_server
        self.current.append(what)


CHILDREN = _Children()
_popen_init = subprocess.Popen.__init__
_process_start = multiprocessing.process.BaseProcess.start


def _counting_popen_init(self, args, *rest, **kwargs):
    words = [str(a) for a in args] if isinstance(args, (list, tuple)) else [str(args)]
    is_server = "asyncgrpo.cli" in words and "serve" in words
    CHILDREN.record(" ".join(words)[:200], is_server)
    _popen_init(self, args, *rest, **kwargs)


def _counting_process_start(self):
    CHILDREN.record(f"multiprocessing {type(self).__name__} {self.name}", False)
    _process_start(self)


def pytest_configure(config):
    subprocess.Popen.__init__ = _counting_popen_init
    multiprocessing.process.BaseProcess.start = _counting_process_start


def pytest_unconfigure(config):
    subprocess.Popen.__init__ = _popen_init
    multiprocessing.process.BaseProcess.start = _process_start


# -- tiers -------------------------------------------------------------------------------------------


_TIER_COUNTS: dict[str, int] = {}  # tests collected per tier, before -m deselects


def pytest_collection_modifyitems(config, items):
    _TIER_COUNTS.clear()
    for item in items:
        tiers = {m.name for m in item.iter_markers() if m.name in TIERS}
        if "server_pool" in item.fixturenames and "process" not in tiers:
            if tiers:
                raise pytest.UsageError(f"{item.nodeid} uses the server pool: its tier is `process`, not "
                                        f"{tiers}")
            item.add_marker(pytest.mark.process)
            tiers = {"process"}
        if len(tiers) > 1:
            raise pytest.UsageError(f"{item.nodeid} has tiers {sorted(tiers)}; give it one")
        if not tiers and item.get_closest_marker("gpu") is None:
            item.add_marker(pytest.mark.unit)
            tiers = {"unit"}
        for tier in tiers or {"gpu"}:
            _TIER_COUNTS[tier] = _TIER_COUNTS.get(tier, 0) + 1


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    CHILDREN.current = []  # before any fixture: a module's server fixture counts for its first test


@pytest.fixture(autouse=True)
def _tier_guard(request):
    """A `unit` or `engine` test that starts a child process fails, naming what it started."""
    yield
    started, CHILDREN.current = CHILDREN.current, []
    if started and request.node.get_closest_marker("process") is None and request.node.get_closest_marker(
            "gpu") is None:
        pytest.fail(f"this test started {len(started)} child process(es) ({started[0]!r}); mark it "
                    "`pytest.mark.process` (tests/conftest.py)", pytrace=False)


# -- the server pool ---------------------------------------------------------------------------------


class ServerPool:
    """Embedded servers keyed by what makes them differ; one start per key for the session.

    At most `max_alive` servers run at once (each holds its model and a few hundred MB); the least
    recently used one stops first, and a later request for its key starts it again."""

    def __init__(self, log_dir: Path, max_alive: int = 4) -> None:
        self.log_dir = log_dir
        self.max_alive = max_alive
        self.servers: OrderedDict[tuple, object] = OrderedDict()
        self.num_starts = 0

    def get(self, model: str = TINY, *flags: str, env: dict[str, str] | None = None,
            purpose: str = "shared", **kwargs):
        from asyncgrpo.launch import EmbeddedServer

        key = (model, flags, tuple(sorted((env or {}).items())), purpose, tuple(sorted(kwargs.items())))
        server = self.servers.get(key)
        if server is not None and server.process is not None and server.process.poll() is None:
            self.servers.move_to_end(key)
            return server
        if server is not None:  # a test stopped or killed it: the next user gets a fresh one
            server.stop()
            del self.servers[key]
        while len(self.servers) >= self.max_alive:
            _, oldest = self.servers.popitem(last=False)
            oldest.stop()
        self.num_starts += 1
        log = self.log_dir / f"{self.num_starts:02d}-{purpose}.log"
        server = EmbeddedServer(model, extra_args=list(flags), env=env, log_path=log, **kwargs).start()
        self.servers[key] = server
        return server

    def close(self) -> None:
        while self.servers:
            self.servers.popitem()[1].stop()


_POOL: list[ServerPool] = []  # the session's pool, for the summary


@pytest.fixture(scope="session")
def server_pool(tmp_path_factory):
    pool = ServerPool(tmp_path_factory.mktemp("servers"))
    _POOL.append(pool)
    yield pool
    pool.close()


@pytest.fixture(scope="session")
def embedded_server(server_pool):
    """`embedded_server(model=TINY, *flags, env=None, purpose="shared")`: a running embedded server
    shared with every test that asks for the same arguments. Give a `purpose` of your own when the test
    leaves state behind (pushed weights, loaded adapters). Call it from a function-scoped fixture: the
    lookup is cheap, and a server the pool stopped to make room starts again."""
    return server_pool.get


def pytest_terminal_summary(terminalreporter):
    terminalreporter.write_line("tests collected per tier: " + ", ".join(
        f"{tier} {_TIER_COUNTS.get(tier, 0)}" for tier in (*TIERS, "gpu")))
    pooled = f" ({_POOL[0].num_starts} from the pool)" if _POOL else ""
    terminalreporter.write_line(
        f"child processes started by pytest: {CHILDREN.num_processes}; `asyncgrpo serve` runs: "
        f"{CHILDREN.num_servers}{pooled}")
