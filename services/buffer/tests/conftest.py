"""Shared fixtures of the buffer tests: group factories, an in-process core over real Redis, and real
`miles-buffer` subprocesses (restartable on the same ports, for crash tests)."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import redis

from miles.buffer.client import BufferClient, RetryPolicy
from miles.buffer.core import Buffer
from miles.buffer.metrics import BufferMetrics
from miles.buffer.settings import BufferSettings
from miles.buffer.store import RedisStore, connect_redis
from miles.common.telemetry import Metrics
from miles.common.testing import RedisServer, ServiceProcess, free_port
from miles.common.testing.smoke import console_script
from miles.proto.common.v1 import common_pb2

GroupFactory = Callable[..., common_pb2.Group]
COMPLETED = common_pb2.SAMPLE_STATUS_COMPLETED
ABORTED = common_pb2.SAMPLE_STATUS_ABORTED


def build_group(
    group_id: str,
    *,
    versions: Sequence[int] = (0,),
    num_samples: int = 2,
    num_prompt_tokens: int = 4,
    num_response_tokens: int = 4,
    rewards: Sequence[float] | None = None,
    statuses: Sequence[int] | None = None,
    prompt_index: int = 0,
    epoch: int = 0,
) -> common_pb2.Group:
    """A valid group: each sample's response is split into one span per entry of `versions`."""
    group = common_pb2.Group(group_id=group_id, prompt_index=prompt_index, epoch=epoch)
    num_tokens = num_prompt_tokens + num_response_tokens
    for index in range(num_samples):
        sample = group.samples.add(
            sample_id=f"{group_id}/{index}",
            group_id=group_id,
            episode_id=f"{group_id}/e{index}",
            tokens=[(7 * index + token) % 1000 for token in range(num_tokens)],
            response_start=num_prompt_tokens,
            loss_mask=[1] * num_response_tokens,
            rollout_logprobs=[-0.5] * num_response_tokens,
            reward=float(rewards[index]) if rewards is not None else float(index),
            status=statuses[index] if statuses is not None else COMPLETED,
        )
        span_length = max(1, num_response_tokens // len(versions))
        for span_index, version in enumerate(versions):
            start = span_index * span_length
            end = num_response_tokens if span_index == len(versions) - 1 else start + span_length
            sample.weight_versions.add(start=start, end=end, weight_version=version)
    return group


@pytest.fixture
def make_group() -> GroupFactory:
    return build_group


@pytest.fixture
async def buffer_core(redis_url: str) -> AsyncIterator[Buffer]:
    """The buffer core in this process over the session's real Redis (flushed), with fast polling."""
    settings = BufferSettings(redis_url=redis_url, poll_interval_s=0.02, push_wait_max_s=5.0)
    client = connect_redis(redis_url, max_connections=16, socket_timeout_s=10.0)
    store = RedisStore(client, key_prefix="test:buffer", dedupe_window_s=3600.0, dedupe_max_ids=1000)
    buffer = Buffer(store, settings, BufferMetrics(Metrics("buffer")))
    yield buffer
    await buffer.close()


@dataclass
class BufferProcess:
    """A real miles-buffer subprocess on fixed ports, restartable after kill -9 on the same ports."""

    redis_url: str
    log_dir: Path
    extra_env: dict[str, str] = field(default_factory=dict)
    port: int = field(default_factory=free_port)
    metrics_port: int = field(default_factory=free_port)
    process: ServiceProcess | None = None

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.metrics_port}/metrics"

    def start(self) -> BufferProcess:
        env = {
            "MILES_BUFFER_REDIS_URL": self.redis_url,
            "MILES_BUFFER_PORT": str(self.port),
            "MILES_BUFFER_METRICS_PORT": str(self.metrics_port),
            "MILES_BUFFER_LEASE_REAP_INTERVAL_S": "0.2",
            "MILES_BUFFER_POLL_INTERVAL_S": "0.05",
            "MILES_BUFFER_STATS_REFRESH_INTERVAL_S": "0.5",
            **self.extra_env,
        }
        self.process = ServiceProcess(
            [console_script("miles-buffer")],
            ready_url=f"http://127.0.0.1:{self.metrics_port}/readyz",
            env=env,
            log_path=self.log_dir / "miles-buffer.log",
        ).start()
        return self

    def kill9(self) -> None:
        assert self.process is not None
        self.process.kill9()

    def stop(self) -> None:
        if self.process is not None:
            self.process.stop()

    def client(self, **kwargs: object) -> BufferClient:
        kwargs.setdefault("retry", RetryPolicy(max_attempts=200, initial_backoff_s=0.05, max_backoff_s=0.5))
        return BufferClient(self.target, **kwargs)  # type: ignore[arg-type]


@pytest.fixture
def start_buffer(tmp_path: Path) -> Iterator[Callable[..., BufferProcess]]:
    """Starts miles-buffer subprocesses over a given Redis URL; stops them all after the test."""
    started: list[BufferProcess] = []

    def start(redis_url: str, **extra_env: str) -> BufferProcess:
        process = BufferProcess(redis_url, tmp_path / f"buffer-{len(started)}", extra_env=dict(extra_env)).start()
        started.append(process)
        return process

    yield start
    for process in started:
        process.stop()


@pytest.fixture
def buffer_process(redis_url: str, start_buffer: Callable[..., BufferProcess]) -> BufferProcess:
    """A miles-buffer subprocess of its own over the session's Redis (flushed)."""
    return start_buffer(redis_url)


@pytest.fixture(scope="module")
def module_redis_url(redis_server: RedisServer) -> str:
    """A DB of the session's Redis of its own (other tests flush DB 0), flushed for this module."""
    url = redis_server.url.rsplit("/", 1)[0] + "/3"
    client = redis.Redis.from_url(url)
    client.flushdb()
    client.close()
    return url


@pytest.fixture(scope="module")
def shared_buffer(module_redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[BufferProcess]:
    """One miles-buffer subprocess for a whole test module (tests use distinct job ids)."""
    process = BufferProcess(module_redis_url, tmp_path_factory.mktemp("buffer")).start()
    yield process
    process.stop()


@pytest.fixture
def job_id(request: pytest.FixtureRequest) -> str:
    """A job id unique to the test (its node id, made key-safe)."""
    return "job-" + "".join(ch if ch.isalnum() else "-" for ch in request.node.name)[:150] + f"-{os.getpid()}"
