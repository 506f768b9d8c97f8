"""The local backend with real processes: a job's engines (fake model), weight-sync origin, rollout worker and
trainer against real shared services (Redis, router, buffer, session server) started here.

Covered: a job trains to its last step and the new weights reach the engines; the engines join the router pool
named after the job; a second backend instance (a restarted controller) adopts the running processes instead of
starting new ones; a killed engine comes back on its URL and re-joins the pool; resizing engines and workers
while the job runs; stop leaves no process and an empty pool; a process that keeps crashing fails the job with
its name and log tail; specs it cannot run (sglang engines) fail at once; a reused pid (another kernel start time)
is neither adopted nor signalled; each transport gives the trainer the publish settings the chart gives it.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from local_backend_testkit import (
    REPO_ROOT,
    Shared,
    assert_all_gone,
    job_spec,
    run,
    start_shared,
    wait_for,
)

from miles.common.errors import InvalidArgumentError
from miles.common.testing import RedisServer
from miles.controller.backends import local_layout
from miles.controller.backends.base import SharedServices
from miles.controller.backends.local import LocalJobBackend
from miles.controller.backends.local_processes import ProcessRecord, ProcessTable, proc_start_time

pytestmark = [pytest.mark.integration]

REDIS_DB = 7


@pytest.fixture(scope="module")
def shared(redis_server: RedisServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Shared]:
    running = start_shared(redis_server, tmp_path_factory.mktemp("shared"), tmp_path_factory.mktemp("model"), REDIS_DB)
    yield running
    running.stop()


@pytest.fixture
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    event_loop = asyncio.new_event_loop()
    asyncio.set_event_loop(event_loop)
    yield event_loop
    event_loop.close()


@pytest.mark.slow  # a real job through adoption, a restart and a resize: about 90 s of the 2-core make test
def test_local_job_trains_adopts_restarts_resizes_and_stops(
    shared: Shared, tmp_path: Path, loop: asyncio.AbstractEventLoop
) -> None:
    job_id, spec = "job-local-a", job_spec(shared.model)
    shared.register_job(job_id)
    backend = LocalJobBackend(shared.services(), tmp_path, cwd=REPO_ROOT, restart_backoff_initial_s=0.2)
    pids: dict[str, int] = {}
    try:
        run(backend.start(job_id, spec))
        progress = wait_for(backend, job_id, spec, lambda p: p.phase != "starting")
        assert progress.phase == "running", progress
        assert progress.pools == {"engines": 1, "rollout_workers": 1, "trainer": 1}
        engine_url = backend.endpoints(job_id)["engines"][0]
        assert set(shared.pool_engines(job_id)) == {engine_url}
        pids = backend.pids(job_id)
        assert set(pids) == {"engine-0", "weightsync", "worker-0", "trainer"}
        for name in pids:
            assert (tmp_path / "jobs" / job_id / f"{name}.pid").read_text().split()[0] == str(pids[name])

        # A restarted controller: a new backend over the same state dir adopts every process.
        run(backend.close())
        backend = LocalJobBackend(shared.services(), tmp_path, cwd=REPO_ROOT, restart_backoff_initial_s=0.2)
        run(backend.start(job_id, spec))
        assert backend.pids(job_id) == pids

        # A crashed engine comes back on the same URL and re-joins the pool.
        os.killpg(pids["engine-0"], signal.SIGKILL)
        wait_for(backend, job_id, spec, lambda p: backend.pids(job_id).get("engine-0", 0) not in (0, pids["engine-0"]))
        wait_for(backend, job_id, spec, lambda p: p.pools.get("engines") == 1 and bool(shared.pool_engines(job_id)))
        assert set(shared.pool_engines(job_id)) == {engine_url}

        # The job trains to its last step and the new weights reach the engine (through weight-sync).
        progress = wait_for(backend, job_id, spec, lambda p: p.phase == "succeeded")
        assert progress.step == 2 and progress.weight_version == 2
        wait_for(backend, job_id, spec, lambda p: shared.pool_engines(job_id)[engine_url]["weight_version"] >= 1)

        # Resize while running: 2 engines (both in the pool), 2 workers; then back to 1 engine.
        run(backend.resize(job_id, spec, engines=2, rollout_workers=2))
        progress = wait_for(
            backend, job_id, spec, lambda p: p.pools.get("engines") == 2 and len(shared.pool_engines(job_id)) == 2
        )
        assert progress.pools["rollout_workers"] == 2
        new_engine = next(url for url in backend.endpoints(job_id)["engines"] if url != engine_url)
        # The joining engine starts on the initial weights: the router gives it no request until it reports the
        # pool's version (unless weight-sync already caught it up), then it catches up with the latest version.
        joined = shared.pool_engines(job_id)[new_engine]
        assert joined["weight_version"] >= 1 or joined["admit_at_weight_version"] >= 1, joined
        wait_for(backend, job_id, spec, lambda p: shared.pool_engines(job_id)[new_engine]["state"] == "healthy")
        assert shared.pool_engines(job_id)[new_engine]["weight_version"] >= 1
        pids = backend.pids(job_id)
        run(backend.resize(job_id, spec, engines=1, rollout_workers=None))
        assert set(shared.pool_engines(job_id)) == {engine_url}
        assert proc_start_time(pids["engine-1"]) is None
        assert backend.pids(job_id)["worker-1"] == pids["worker-1"]
        pids = backend.pids(job_id)
    finally:
        run(backend.stop(job_id))
        run(backend.close())
    assert_all_gone(pids)
    assert shared.pool_engines(job_id) == {}
    assert not list((tmp_path / "jobs" / job_id).glob("*.pid"))


def test_process_that_keeps_crashing_fails_the_job_with_its_log(
    shared: Shared, tmp_path: Path, loop: asyncio.AbstractEventLoop
) -> None:
    job_id = "job-local-crash"
    spec = job_spec(
        shared.model,
        resources={"engines": {"replicas": 1, "extra_args": ["--fake-model", "--no-such-flag"]}},
    )
    backend = LocalJobBackend(shared.services(), tmp_path, cwd=REPO_ROOT, max_restarts=2, restart_backoff_initial_s=0.1)
    try:
        run(backend.start(job_id, spec))
        progress = wait_for(backend, job_id, spec, lambda p: p.phase == "failed")
        assert "engine-0 exited with code 2 after 2 restarts" in progress.error
        assert "--no-such-flag" in progress.error  # the log tail names the cause
        record = json.loads((tmp_path / "jobs" / job_id / "state.json").read_text())
        engine = next(p for p in record["processes"] if p["name"] == "engine-0")
        assert engine["total_restarts"] == 2
    finally:
        pids = backend.pids(job_id)
        run(backend.stop(job_id))
        run(backend.close())
    assert_all_gone(pids)


@pytest.mark.parametrize(
    ("overrides", "reason"),
    [
        ({"resources": {"engines": {"kind": "sglang"}}}, "engines.kind 'sglang' needs the kubernetes backend"),
    ],
)
def test_specs_the_local_backend_cannot_run_fail_without_starting_anything(
    tmp_path: Path, loop: asyncio.AbstractEventLoop, overrides: dict[str, Any], reason: str
) -> None:
    services = SharedServices("redis://127.0.0.1:1/0", "", "", "", "", "", "", "")
    backend = LocalJobBackend(services, tmp_path)
    spec = job_spec(Path("/nonexistent"), **overrides)
    run(backend.start("job-bad", spec))
    progress = run(backend.observe("job-bad", spec))
    assert progress.phase == "failed" and reason in progress.error
    assert backend.pids("job-bad") == {}
    run(backend.close())


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"resources": {"engines": {"kind": "sglang"}}}, "resources.engines.kind"),
    ],
)
def test_the_local_backend_refuses_what_it_cannot_run_at_submission(
    tmp_path: Path, overrides: dict[str, Any], field: str
) -> None:
    backend = LocalJobBackend(SharedServices("redis://127.0.0.1:1/0", "", "", "", "", "", "", ""), tmp_path)
    with pytest.raises(InvalidArgumentError, match="local backend") as refused:
        asyncio.run(backend.check_spec(job_spec(Path("/m"), **overrides)))
    assert refused.value.field == field
    for transport in ("stream", "nccl", "disk"):  # cpu engines: every transport runs locally (nccl over gloo)
        asyncio.run(backend.check_spec(job_spec(Path("/m"), weight_sync={"transport": transport})))


def test_each_transport_gives_the_trainer_what_the_chart_gives_it(tmp_path: Path) -> None:
    services = SharedServices("redis://r", "http://127.0.0.1:8000", "", "", "127.0.0.1:50051", "", "", "")
    sections = {
        transport: local_layout.trainer_publish_section(
            tmp_path, "job-x", job_spec(Path("/m"), weight_sync={"transport": transport}), services, "127.0.0.1:7"
        )
        for transport in ("stream", "nccl", "disk")
    }
    assert sections["stream"] == {"kind": "stream", "dtype": "bfloat16", "weightsync_address": "127.0.0.1:7"}
    for transport in ("nccl", "disk"):
        assert sections[transport]["router_url"] == "http://127.0.0.1:8000" and sections[transport]["pool"] == "job-x"
    assert (sections["nccl"]["nccl_backend"], sections["nccl"]["nccl_master_port"]) == ("gloo", 0)
    assert sections["disk"]["dir"] == str(tmp_path / "published")
    assert sections["nccl"]["pause_mode"] == sections["disk"]["pause_mode"] == "in_place"  # the CPU engine's default
    assert local_layout.uses_weightsync(job_spec(Path("/m")))
    assert not local_layout.uses_weightsync(job_spec(Path("/m"), weight_sync={"transport": "nccl"}))


def test_a_reused_pid_is_neither_adopted_nor_signalled(tmp_path: Path) -> None:
    table = ProcessTable(tmp_path)
    log_path = str(tmp_path / "worker-0.log")
    record = ProcessRecord(name="worker-0", role="worker", argv=["sleep", "60"], env={}, log_path=log_path)
    table.spawn(record, tmp_path)
    assert table.is_running(record) and record.start_time == proc_start_time(record.pid)
    assert (tmp_path / "worker-0.pid").read_text().split() == [str(record.pid), str(record.start_time)]
    # The same pid with another start time is another process (the pid was reused): not ours.
    stranger = ProcessRecord.from_json({**record.to_json(), "start_time": record.start_time + 1})
    assert ProcessTable(tmp_path).exit_code(stranger) == -1
    ProcessTable(tmp_path).stop_all([stranger], grace_s=0.1)
    assert table.is_running(record)
    # A fresh table (a restarted controller) recognises the real one and stops it.
    adopted = ProcessRecord.from_json(record.to_json())
    ProcessTable(tmp_path).stop_all([adopted], grace_s=5)
    assert table.exit_code(record) == -signal.SIGTERM
