"""Shared helpers of the controller's API tests: a fake backend (the only fake: it stands in for per-job
processes / Kubernetes objects) and a real controller app served over a real socket against the real Redis. The
Kubernetes backend's fake API server is controller_kubernetes_testkit.py (this folder is put on sys.path)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from miles.common.jobspec.job import JobSpec
from miles.common.serve import serve_async
from miles.common.telemetry import Metrics
from miles.common.testing.ports import free_port
from miles.controller.backends.base import JobProgress
from miles.controller.main import build_service
from miles.controller.settings import ControllerSettings

sys.path.insert(0, str(Path(__file__).parent))

API_TOKEN = "test-token-0123456789abcdef"
AUTH = {"authorization": f"Bearer {API_TOKEN}"}


def job_spec_body(num_steps: int = 3, **overrides: Any) -> dict[str, Any]:
    """A valid JobSpec as JSON (the rollout section of the calculator demo, shortened)."""
    body: dict[str, Any] = {
        "name": "test-job",
        "model": {"path": "/models/tiny", "family": "qwen3"},
        "rollout": {
            "dataset": {"path": "examples/calculator_tool/data.jsonl"},
            "agent": {"function": "calculator_tool.agent:agent", "python_path": ["examples"]},
            "n_samples_per_prompt": 4,
        },
        "train": {"mode": "async", "max_staleness": 2, "batch_size_groups": 2, "num_steps": num_steps},
        "resources": {"engines": {"replicas": 2}, "rollout_workers": {"replicas": 1}},
    }
    body.update(overrides)
    return body


@dataclass
class FakeJob:
    """What the fake backend 'runs' for one job: it survives controller restarts, like real processes."""

    spec: JobSpec
    step: int = 0
    phase: str = "running"
    error: str = ""
    engines: int = 0
    rollout_workers: int = 0
    starts: int = 0
    auto_step: bool = True
    step_finished_unix_ms: int = 0
    """What the trainer's Status says of the current version's step (0: unknown)."""


@dataclass
class FakeBackend:
    """A JobBackend in memory. Each observe advances a running job by one step (auto_step) until num_steps."""

    name: str = "fake"
    jobs: dict[str, FakeJob] = field(default_factory=dict)
    calls: list[tuple[str, str]] = field(default_factory=list)
    fail_start: str = ""
    auto_step: bool = True
    closed: int = 0
    record_routing: dict[str, bool | None] = field(default_factory=dict)
    """The `record_routing` each job's last start was given (the session server's answer at registration)."""

    async def check_spec(self, spec: JobSpec) -> None:
        self.calls.append(("check_spec", spec.name))

    async def start(self, job_id: str, spec: JobSpec, *, record_routing: bool | None = None) -> None:
        self.calls.append(("start", job_id))
        self.record_routing[job_id] = record_routing
        if self.fail_start:
            from miles.common.errors import InvalidArgumentError

            raise InvalidArgumentError(self.fail_start)
        job = self.jobs.get(job_id)
        if job is None:
            resources = spec.resources
            job = FakeJob(spec, engines=resources.engines.replicas, rollout_workers=resources.rollout_workers.replicas)
            job.auto_step = self.auto_step
            self.jobs[job_id] = job
        job.starts += 1

    async def observe(self, job_id: str, spec: JobSpec) -> JobProgress:
        job = self.jobs[job_id]
        if job.phase == "running" and job.auto_step:
            job.step = min(job.step + 1, spec.train.num_steps)
            if job.step >= spec.train.num_steps:
                job.phase = "succeeded"
        pools = {"engines": job.engines, "rollout_workers": job.rollout_workers, "trainer": 1}
        metrics = {"reward_mean": 0.1 * job.step, "staleness_mean": 0.5, "tito_critical_episodes": 0.0}
        return JobProgress(
            phase=job.phase,  # type: ignore[arg-type]
            step=job.step,
            weight_version=job.step,
            error=job.error,
            pools=pools,
            metrics=metrics,
            step_finished_unix_ms=job.step_finished_unix_ms,
        )

    async def resize(self, job_id: str, spec: JobSpec, *, engines: int | None, rollout_workers: int | None) -> None:
        self.calls.append(("resize", job_id))
        job = self.jobs[job_id]
        if engines is not None:
            job.engines = engines
        if rollout_workers is not None:
            job.rollout_workers = rollout_workers

    async def stop(self, job_id: str) -> None:
        self.calls.append(("stop", job_id))
        self.jobs.pop(job_id, None)

    async def close(self) -> None:
        self.closed += 1


def make_settings(redis_url: str, **overrides: Any) -> ControllerSettings:
    values: dict[str, Any] = {
        "redis_url": redis_url,
        "api_tokens": [API_TOKEN],
        "session_url": "",
        "buffer_address": "",
        "router_url": "",
        "observe_interval_s": 0.05,
        "leader_lease_s": 3.0,
        "cancel_wait_s": 5.0,
        "sse_keepalive_s": 1.0,
        "log_json": False,
        **overrides,
    }
    return ControllerSettings(**values)


@contextlib.asynccontextmanager
async def running_controller(settings: ControllerSettings, backend: Any) -> AsyncIterator[httpx.AsyncClient]:
    """The controller app served on a free port (its lifespan runs the supervisor); yields a client of it."""
    app = build_service(settings, Metrics("controller"), backend=backend)
    stop = asyncio.Event()
    port = free_port()
    server = asyncio.create_task(
        serve_async(http_app=app, http_port=port, stop_event=stop, handle_signals=False, grace_s=1.0)
    )
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", headers=AUTH, timeout=30.0) as client:
        for _ in range(200):
            with contextlib.suppress(httpx.HTTPError):
                if (await client.get("/healthz")).status_code == 200:
                    break
            await asyncio.sleep(0.02)
        try:
            yield client
        finally:
            stop.set()
            # A bound against a hang at shutdown (a failure to investigate), not a speed check.
            await asyncio.wait_for(server, timeout=120)


async def wait_for_state(
    client: httpx.AsyncClient, job_id: str, *states: str, timeout_s: float = 30.0
) -> dict[str, Any]:
    """Poll GET /v1/jobs/{id} until the job is in one of `states` (a generous bound, not a speed check)."""
    body: dict[str, Any] = {}
    for _ in range(int(timeout_s / 0.05)):
        response = await client.get(f"/v1/jobs/{job_id}")
        body = response.json()
        if body.get("state") in states:
            return body
        await asyncio.sleep(0.05)
    raise AssertionError(f"job {job_id} never reached {states}; last: {json.dumps(body)[:500]}")


async def wait_until(predicate: Callable[[], bool], timeout_s: float = 30.0) -> None:
    for _ in range(int(timeout_s / 0.02)):
        if predicate():
            return
        await asyncio.sleep(0.02)
    raise AssertionError("condition never became true")


@pytest.fixture
def fake_backend() -> FakeBackend:
    return FakeBackend()


class ControllerKit:
    """The helpers above, for test modules (which cannot import this conftest): the `controller_kit` fixture."""

    token = API_TOKEN
    auth = AUTH
    FakeBackend = FakeBackend
    job_spec_body = staticmethod(job_spec_body)
    make_settings = staticmethod(make_settings)
    running = staticmethod(running_controller)
    wait_for_state = staticmethod(wait_for_state)
    wait_until = staticmethod(wait_until)


@pytest.fixture
def controller_kit() -> type[ControllerKit]:
    return ControllerKit
