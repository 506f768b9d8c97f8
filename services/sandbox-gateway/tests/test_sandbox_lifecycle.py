"""Lifecycle of sandboxes in the gateway core (in process, real local backend): TTL reaper, per-job and
gateway quotas, warm pool, dead sandboxes, destroy during an exec, abandoned streams, shutdown, and the
rlimit-only memory limit when no cgroup is used.
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from miles.common.telemetry import Metrics
from miles.sandbox.backend import make_backend
from miles.sandbox.core import SandboxGateway
from miles.sandbox.errors import QuotaExceededError, SandboxGoneError
from miles.sandbox.local.cgroups import own_cgroup_dirs
from miles.sandbox.metrics import SandboxMetrics
from miles.sandbox.models import CreateParams, ExecParams, ExecResult, LimitKind, Limits, OutputChunk
from miles.sandbox.settings import SandboxSettings

if TYPE_CHECKING:
    from conftest import Gateway

pytestmark = pytest.mark.integration

GatewayFactory = Callable[..., Awaitable[SandboxGateway]]


class FakeClock:
    def __init__(self) -> None:
        self.now_s = 1000.0

    def __call__(self) -> float:
        return self.now_s


@pytest.fixture
async def make_gateway(tmp_path: Path) -> AsyncIterator[GatewayFactory]:
    """make_gateway(**settings): a started in-process gateway; all are closed after the test."""
    started: list[SandboxGateway] = []

    async def make(clock: Callable[[], float] | None = None, **overrides: Any) -> SandboxGateway:
        settings = SandboxSettings(
            state_dir=str(tmp_path / f"state{len(started)}"),
            warm_pool_size=overrides.pop("warm_pool_size", 0),
            reaper_interval_s=overrides.pop("reaper_interval_s", 3600.0),
            **overrides,
        )
        metrics = SandboxMetrics(Metrics("sandbox"))
        gateway = SandboxGateway(settings, make_backend(settings), metrics, **({"clock": clock} if clock else {}))
        await gateway.start()
        started.append(gateway)
        return gateway

    yield make
    for gateway in started:
        await gateway.close()


async def run(gateway: SandboxGateway, sandbox_id: str, **params: Any) -> tuple[bytes, ExecResult]:
    output = b""
    result = None
    async for event in gateway.open_exec(sandbox_id, ExecParams(**params)):
        if isinstance(event, OutputChunk):
            output += event.data
        else:
            result = event
    assert result is not None
    return output, result


async def eventually(predicate: Callable[[], object]) -> None:
    """Wait (polling) until predicate() is true; the test's own timeout bounds the wait."""
    while True:
        if predicate():
            return
        await asyncio.sleep(0.01)


def metric_value(gateway: SandboxGateway, name: str, labels: dict[str, str]) -> float:
    value = gateway.metrics.registry.get_sample_value(name, labels)
    return float(value or 0.0)


async def test_ttl_reaper_destroys_idle_sandboxes_but_not_busy_ones(make_gateway: GatewayFactory) -> None:
    clock = FakeClock()
    gateway = await make_gateway(clock=clock)
    short = (await gateway.create(CreateParams(job_id="j", ttl_s=10))).sandbox_id
    long = (await gateway.create(CreateParams(job_id="j", ttl_s=100))).sandbox_id
    busy = (await gateway.create(CreateParams(job_id="j", ttl_s=1))).sandbox_id
    busy_exec = asyncio.create_task(run(gateway, busy, shell="sleep 1.5; echo done"))
    await eventually(lambda: any(info.active_execs for info in gateway.list_sandboxes()))
    clock.now_s += 11
    assert await gateway.reap_once() == [short]
    assert {info.sandbox_id for info in gateway.list_sandboxes()} == {long, busy}  # busy: an exec is running
    output, _ = await busy_exec
    assert output == b"done\n"
    assert await gateway.reap_once() == []  # the exec's end counts as use
    clock.now_s += 2
    assert await gateway.reap_once() == [busy]
    assert metric_value(gateway, "miles_sandbox_sandboxes_destroyed_total", {"backend": "local", "reason": "ttl"}) == 2


async def test_background_reaper_destroys_expired_sandboxes(make_gateway: GatewayFactory) -> None:
    gateway = await make_gateway(reaper_interval_s=0.05)
    await gateway.create(CreateParams(job_id="j", ttl_s=0.2))
    await eventually(lambda: not gateway.list_sandboxes())
    assert metric_value(gateway, "miles_sandbox_live_sandboxes", {"backend": "local"}) == 0


async def test_per_job_quota_counts_live_and_starting_sandboxes(make_gateway: GatewayFactory) -> None:
    gateway = await make_gateway(max_sandboxes_per_job=2)
    results = await asyncio.gather(
        *(gateway.create(CreateParams(job_id="a")) for _ in range(5)), return_exceptions=True
    )
    created = [result for result in results if not isinstance(result, BaseException)]
    refused = [result for result in results if isinstance(result, QuotaExceededError)]
    assert len(created) == 2 and len(refused) == 3
    assert refused[0].field == "job_id" and refused[0].retry_after_s == 1.0
    other_job = await gateway.create(CreateParams(job_id="b"))  # quotas are per job
    await gateway.destroy(created[0].sandbox_id)  # type: ignore[union-attr]
    await gateway.create(CreateParams(job_id="a"))  # room again
    assert other_job.sandbox_id
    assert metric_value(gateway, "miles_sandbox_quota_rejections_total", {"scope": "job"}) == 3


async def test_gateway_wide_quota(make_gateway: GatewayFactory) -> None:
    gateway = await make_gateway(max_sandboxes=2)
    await gateway.create(CreateParams(job_id="a"))
    await gateway.create(CreateParams(job_id="b"))
    with pytest.raises(QuotaExceededError):
        await gateway.create(CreateParams(job_id="c"))


async def test_warm_pool_serves_creates_with_the_requested_limits_and_refills(make_gateway: GatewayFactory) -> None:
    gateway = await make_gateway(warm_pool_size=2)
    pool = gateway.pool
    assert pool is not None
    await eventually(lambda: len(pool) == 2)
    created = await gateway.create(CreateParams(job_id="j", limits=Limits(memory_bytes=64 << 20)))
    assert created.warm and created.limits.memory_bytes == 64 << 20
    _, result = await run(gateway, created.sandbox_id, argv=("python3", "-c", "x = bytearray(200 << 20)"))
    assert LimitKind.MEMORY in result.limits_hit  # the pooled sandbox took the requested (smaller) limit
    await eventually(lambda: len(pool) == 2)  # refilled in the background
    warm = metric_value(gateway, "miles_sandbox_sandboxes_created_total", {"backend": "local", "source": "warm"})
    assert warm == 1
    buckets = {"backend": "local", "source": "warm"}
    assert metric_value(gateway, "miles_sandbox_startup_duration_seconds_count", buckets) == 1


async def test_without_a_pool_sandboxes_start_cold(make_gateway: GatewayFactory) -> None:
    gateway = await make_gateway(warm_pool_size=0)
    created = await gateway.create(CreateParams())
    assert not created.warm and created.startup_s > 0
    labels = {"backend": "local", "source": "cold"}
    assert metric_value(gateway, "miles_sandbox_startup_duration_seconds_count", labels) == 1


async def test_a_dead_sandbox_is_reported_and_reaped(make_gateway: GatewayFactory) -> None:
    gateway = await make_gateway()
    sandbox_id = (await gateway.create(CreateParams())).sandbox_id
    keeper = gateway.backend._sandboxes[sandbox_id].keeper  # type: ignore[attr-defined]
    os.kill(keeper.namespace_pid, signal.SIGKILL)  # what an OOM kill or a crash of the keeper looks like
    await eventually(lambda: not gateway.backend.is_alive(sandbox_id))
    with pytest.raises(SandboxGoneError):
        await run(gateway, sandbox_id, argv=("true",))
    assert await gateway.reap_once() == [sandbox_id]
    assert metric_value(gateway, "miles_sandbox_sandboxes_destroyed_total", {"backend": "local", "reason": "dead"}) == 1


async def test_destroy_during_an_exec_ends_the_exec(make_gateway: GatewayFactory) -> None:
    gateway = await make_gateway()
    sandbox_id = (await gateway.create(CreateParams())).sandbox_id
    events = gateway.open_exec(sandbox_id, ExecParams(shell="echo started; sleep 60", timeout_s=120))
    assert await anext(events) == OutputChunk("stdout", b"started\n")
    assert await gateway.destroy(sandbox_id)
    remaining = [event async for event in events]
    assert len(remaining) == 1 and isinstance(remaining[0], ExecResult)
    assert remaining[0].signal == signal.SIGKILL and LimitKind.TIMEOUT not in remaining[0].limits_hit


async def test_an_abandoned_exec_stream_kills_its_processes(
    make_gateway: GatewayFactory, uid_processes: Callable[[int], list[int]]
) -> None:
    gateway = await make_gateway()
    sandbox_id = (await gateway.create(CreateParams())).sandbox_id
    uid_output, _ = await run(gateway, sandbox_id, argv=("id", "-u"))
    uid = int(uid_output)
    events = gateway.open_exec(sandbox_id, ExecParams(shell="echo started; exec sleep 60", timeout_s=120))
    first = await anext(events)
    assert isinstance(first, OutputChunk) and first.data == b"started\n"
    assert uid_processes(uid)  # sleep is running
    await events.aclose()  # the client went away
    await eventually(lambda: not uid_processes(uid))
    assert gateway.list_sandboxes()[0].active_execs == 0


async def test_shutdown_destroys_every_sandbox(tmp_path: Path, uid_processes: Callable[[int], list[int]]) -> None:
    settings = SandboxSettings(state_dir=str(tmp_path / "state"), warm_pool_size=1)
    gateway = SandboxGateway(settings, make_backend(settings), SandboxMetrics(Metrics("sandbox")))
    await gateway.start()
    uids = []
    for _ in range(3):
        sandbox_id = (await gateway.create(CreateParams())).sandbox_id
        output, _ = await run(gateway, sandbox_id, shell="setsid sleep 60 >/dev/null 2>&1 < /dev/null & id -u")
        uids.append(int(output))
    await gateway.close()
    assert all(uid_processes(uid) == [] for uid in uids)
    assert list((tmp_path / "state").iterdir()) == []


@pytest.mark.escape
async def test_memory_limit_without_cgroups_is_the_address_space_rlimit(make_gateway: GatewayFactory) -> None:
    gateway = await make_gateway(cgroup_mode="off")
    sandbox_id = (await gateway.create(CreateParams(limits=Limits(memory_bytes=128 << 20)))).sandbox_id
    bomb = "chunks = []\nwhile True:\n    chunks.append(bytearray(16 << 20))\n"
    _, result = await run(gateway, sandbox_id, argv=("python3", "-c", bomb))
    assert result.exit_code == 1 and LimitKind.MEMORY in result.limits_hit
    ok, _ = await run(gateway, sandbox_id, argv=("echo", "ok"))
    assert ok == b"ok\n"


@pytest.mark.escape
def test_a_crashed_gateway_takes_its_sandboxes_along_and_a_restart_cleans_up(
    start_gateway_process: Callable[..., Gateway], uid_processes_end: Callable[[int], bool]
) -> None:
    first = start_gateway_process(WARM_POOL_SIZE="1")
    sandbox_id = first.client.create(job_id="crash").sandbox_id
    uid = int(first.client.exec(sandbox_id, shell="setsid sleep 300 </dev/null >/dev/null 2>&1 & id -u").text)
    assert (first.state_dir / sandbox_id).is_dir()
    cgroup_dirs = [own / f"miles-sandbox-{first.pid}" for _, own in own_cgroup_dirs().values()]
    assert all(directory.is_dir() for directory in cgroup_dirs)
    first.process.kill9()  # no shutdown hook runs
    assert uid_processes_end(uid)  # bwrap --die-with-parent: the sandbox died with its gateway
    second = start_gateway_process()  # same state_dir
    assert not (second.state_dir / sandbox_id).exists()  # the dead gateway's work dirs are removed at start-up
    assert not any(directory.exists() for directory in cgroup_dirs)  # and so are its cgroups
