"""Pytest fixtures and markers shared by every test in the repo (loaded by the root conftest.py).

Markers: integration, e2e, slow, gpu (skipped when torch or CUDA is missing), escape (sandbox escape suite).
Fixtures: `redis_server` (session-scoped real redis-server), `redis_url` (a fresh, flushed DB per test),
`span_exporter` (in-memory OpenTelemetry exporter installed once per test session).

Process-free tests: `-m "not integration and not e2e and not slow"` (make test-unit) selects the tests that start no
process. A test that uses `redis_server` (or a fixture built on it, such as `redis_url`) is marked integration
at collection; any other test that starts a process (a service, a redis-server, helm, git, ...: subprocess,
fork, posix_spawn, os.system, multiprocessing), in its own code or in a fixture set up for it, fails unless it is
marked integration, e2e or slow, so that the markers cannot drift.

Parallel runs (pytest-xdist, make test): the session fixtures run once per worker, on free ports and in per-worker
temporary directories; each worker gets its own slice of sandbox uids; every process computes with one OpenMP
thread and hashes strings alike (OMP_NUM_THREADS=1, PYTHONHASHSEED=0 unless set); the workers run the files with
slow, e2e and integration tests first.
"""

from __future__ import annotations

import functools
import importlib.util
import multiprocessing.util
import os
import subprocess
import threading
import traceback
from collections.abc import Callable, Generator, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from miles.common.telemetry import setup_tracing
from miles.common.testing.ports import free_port
from miles.common.testing.redis_server import RedisServer


def _cuda_available() -> bool:
    if importlib.util.find_spec("torch") is None:
        return False
    import torch

    return bool(torch.cuda.is_available())


RUN_ENVIRONMENT = {"OMP_NUM_THREADS": "1", "PYTHONHASHSEED": "0"}
"""Set for the run (and so for the xdist workers and every process the tests start) unless already set."""


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config: pytest.Config) -> None:
    # OMP_NUM_THREADS: one OpenMP thread per process. A run starts many torch processes at once (xdist workers,
    # engines, trainers) on a few cores, where the spinning threads of OpenMP's default (a thread per core in every
    # process) slowed the heaviest tests tenfold. Set before any test module imports torch.
    # PYTHONHASHSEED: the OpenAPI fuzz runs (openapi_fuzz) are derandomized but schemathesis orders some choices by
    # string hash: with a fixed seed every worker generates the same requests, run after run. It reaches the
    # processes started from here on: the xdist workers and the tests' subprocesses (make test also sets it for
    # the pytest process itself).
    for name, value in RUN_ENVIRONMENT.items():
        os.environ.setdefault(name, value)


PROCESS_MARKERS = ("integration", "e2e", "slow")
"""A test that starts processes carries one of these (and `make test-unit` deselects all three)."""
PROCESS_FIXTURES = frozenset({"redis_server"})
"""Fixtures that start processes: a test whose fixture closure holds one is marked integration at collection."""


def _may_start_processes(item: pytest.Item) -> bool:
    return any(item.get_closest_marker(name) is not None for name in PROCESS_MARKERS)


@pytest.hookimpl(tryfirst=True)  # before -m deselects: the markers added here count
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if PROCESS_FIXTURES.intersection(getattr(item, "fixturenames", ())) and not _may_start_processes(item):
            item.add_marker(pytest.mark.integration)
    gpu_items = [item for item in items if item.get_closest_marker("gpu") is not None]
    if gpu_items and not _cuda_available():
        skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is false)")
        for item in gpu_items:
            item.add_marker(skip_gpu)
    if hasattr(config, "workerinput"):  # an xdist worker: every worker sorts alike, as xdist requires
        _slow_files_first(items)


def _slow_files_first(items: list[pytest.Item]) -> None:
    """Files with slow, then e2e, then integration tests first, each file's tests kept together and in order:
    the longest work starts first and the quick tests fill the workers at the end (a shorter parallel run)."""
    rank: dict[Path, int] = {}
    for item in items:
        item_rank = next(
            (i for i, name in enumerate(("slow", "e2e", "integration")) if item.get_closest_marker(name)), 3
        )
        rank[item.path] = min(rank.get(item.path, item_rank), item_rank)
    items.sort(key=lambda item: rank[item.path])


SANDBOX_UIDS_PER_PROCESS = 2000


@pytest.fixture(scope="session", autouse=True)
def _own_sandbox_uids() -> Iterator[None]:
    """A slice of sandbox uids for this test process (each xdist worker) and the gateways it starts.

    A sandbox gateway in setuid mode hands each sandbox a uid from a fixed range and, when the sandbox goes, kills
    every process of that uid: two gateways on one machine with the same range (two xdist workers, two test runs)
    kill each other's sandboxes. The slice follows the pid, so concurrent runs get different slices too (unless
    MILES_SANDBOX_UID_RANGE_START is set already)."""
    if "MILES_SANDBOX_UID_RANGE_START" in os.environ:
        yield
        return
    start = 300_000 + (os.getpid() % 20_000) * SANDBOX_UIDS_PER_PROCESS
    os.environ["MILES_SANDBOX_UID_RANGE_START"] = str(start)
    os.environ["MILES_SANDBOX_UID_RANGE_SIZE"] = str(SANDBOX_UIDS_PER_PROCESS)
    yield
    for name in ("MILES_SANDBOX_UID_RANGE_START", "MILES_SANDBOX_UID_RANGE_SIZE"):
        os.environ.pop(name, None)


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """A real redis-server (AOF on) on a free loopback port for the whole test session."""
    server = RedisServer(tmp_path_factory.mktemp("redis"), free_port())
    server.start()
    yield server
    server.stop()


@pytest.fixture
def redis_url(redis_server: RedisServer) -> str:
    """URL of the session's Redis with its DB flushed before the test."""
    client = redis.Redis.from_url(redis_server.url)
    client.flushdb()
    client.close()
    return redis_server.url


_EXPORTER = InMemorySpanExporter()


@pytest.fixture
def span_exporter() -> Iterator[InMemorySpanExporter]:
    """The in-memory exporter every span of this process goes to (cleared before each test)."""
    setup_tracing("tests", exporter=_EXPORTER)
    _EXPORTER.clear()
    yield _EXPORTER
    _EXPORTER.clear()


@pytest.fixture
def repo_root(request: pytest.FixtureRequest) -> Path:
    """The repository root (pytest's rootdir, where the root pyproject.toml is)."""
    return Path(request.config.rootpath)


class _ProcessWatch:
    """Records the processes started in this (worker) process while a test runs (its setup, call and teardown),
    and which fixtures started some: a test using such a fixture depends on processes even when the fixture's
    value was cached (session or module scope) by the test that set it up."""

    def __init__(self) -> None:
        self.item: pytest.Item | None = None
        self.started: list[str] = []
        self.process_fixtures: dict[str, str] = {}
        """Fixture name -> the first process its setup started."""
        self._local = threading.local()  # .inside: within a wrapped call (Popen's own fork/posix_spawn)
        self._restore: list[tuple[Any, str, Any]] = []

    def install(self) -> None:
        self._wrap(subprocess.Popen, "_execute_child", lambda args: args[1])  # Popen (run, asyncio's subprocesses)
        for name in ("fork", "forkpty", "posix_spawn", "posix_spawnp", "system"):
            if hasattr(os, name):
                self._wrap(os, name, functools.partial(lambda name, args: f"os.{name}{tuple(args[:1])}", name))
        self._wrap(multiprocessing.util, "spawnv_passfds", lambda args: args[1])  # multiprocessing's spawn

    def uninstall(self) -> None:
        for owner, name, original in reversed(self._restore):
            setattr(owner, name, original)
        self._restore.clear()

    def processes_of(self, item: pytest.Item) -> list[str]:
        """What the test started, and the processes behind the fixtures it uses."""
        fixtures = [
            f"{self.process_fixtures[name]} (fixture {name})"
            for name in getattr(item, "fixturenames", ())
            if name in self.process_fixtures
        ]
        return list(dict.fromkeys([*self.started, *fixtures]))

    def _wrap(self, owner: Any, name: str, describe: Callable[[tuple[Any, ...]], object]) -> None:
        original = getattr(owner, name)

        @functools.wraps(original)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if self.item is None or getattr(self._local, "inside", False):
                return original(*args, **kwargs)
            self._record(describe(args))
            self._local.inside = True
            try:
                return original(*args, **kwargs)
            finally:
                self._local.inside = False

        self._restore.append((owner, name, original))
        setattr(owner, name, wrapper)

    def _record(self, what: object) -> None:
        command = what if isinstance(what, (str, bytes)) else " ".join(map(str, what))  # type: ignore[call-overload]
        frames = [frame for frame in traceback.extract_stack()[:-3] if "/tests/" in frame.filename]
        where = f" ({frames[-1].filename}:{frames[-1].lineno})" if frames else ""
        self.started.append(f"{str(command)[:200]}{where}")


_WATCH = _ProcessWatch()


@pytest.fixture(scope="session", autouse=True)
def _watch_processes() -> Iterator[None]:
    """Installed where tests run (each xdist worker), before any other session fixture starts a process."""
    _WATCH.install()
    yield
    _WATCH.uninstall()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Generator[None, object, object]:
    _WATCH.item, _WATCH.started = item, []
    try:
        return (yield)
    finally:
        _WATCH.item = None


@pytest.hookimpl(wrapper=True)
def pytest_fixture_setup(fixturedef: pytest.FixtureDef[Any], request: pytest.FixtureRequest) -> Generator[None]:
    before = len(_WATCH.started)  # the fixtures it depends on are set up by now: only its own processes count
    try:
        return (yield)
    finally:
        if len(_WATCH.started) > before:
            _WATCH.process_fixtures.setdefault(fixturedef.argname, _WATCH.started[before])


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    report = yield
    if report.when == "call" and report.passed and not _may_start_processes(item):
        started = _WATCH.processes_of(item)
        if started:
            report.outcome = "failed"
            report.longrepr = (
                "this test starts processes but is not marked integration, e2e or slow (make test-unit runs the tests "
                "that start none): mark it, e.g. pytestmark = pytest.mark.integration\n  " + "\n  ".join(started)
            )
    return report
