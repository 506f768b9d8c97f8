"""Pytest fixtures and markers shared by every test in the repo (loaded by the root conftest.py).

Markers: integration, e2e, slow, gpu (skipped when torch or CUDA is missing), escape (sandbox escape suite).
Fixtures: `redis_server` (session-scoped real redis-server), `redis_url` (a fresh, flushed DB per test),
`span_exporter` (in-memory OpenTelemetry exporter installed once per test session).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from pathlib import Path

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


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    gpu_items = [item for item in items if item.get_closest_marker("gpu") is not None]
    if gpu_items and not _cuda_available():
        skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is false)")
        for item in gpu_items:
            item.add_marker(skip_gpu)


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
