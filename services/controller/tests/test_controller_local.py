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
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from miles.common.errors import InvalidArgumentError
from miles.common.jobspec.job import JobSpec
from miles.common.testing import RedisServer, ServiceProcess, free_port, wait_for_http_ready
from miles.common.testing.smoke import console_script
from miles.controller.backends import local_layout
from miles.controller.backends.base import JobProgress, SharedServices
from miles.controller.backends.local import LocalJobBackend
from miles.controller.backends.local_processes import ProcessRecord, ProcessTable, proc_start_time

pytestmark = [pytest.mark.integration]

REPO_ROOT = Path(__file__).resolve().parents[3]
OPERATOR_TOKEN = "local-backend-operator-" + "t" * 24
REDIS_DB = 7


def model_dir(tmp_root: Path) -> Path:
    made = REPO_ROOT / ".miles" / "models" / "tiny-qwen3"
    if (made / "model.safetensors").is_file():
        return made
    from miles.engine.tiny_model import build_tiny_model

    return Path(build_tiny_model(tmp_root / "tiny-qwen3"))


class Shared:
    """Router, buffer and session server over one Redis DB (no sandbox: the math task needs none)."""

    def __init__(self, log_dir: Path, redis_url: str, model: Path) -> None:
        self.log_dir, self.redis_url, self.model = log_dir, redis_url, model
        self.processes: list[ServiceProcess] = []
        port = free_port()
        self.router_url = f"http://127.0.0.1:{port}"
        self._spawn(
            "router",
            {
                "MILES_ROUTER_PORT": str(port),
                "MILES_ROUTER_ADMIN_GRPC_PORT": "-1",
                "MILES_ROUTER_HEALTH_CHECK_INTERVAL_S": "0.5",
                "MILES_ROUTER_VERSION_POLL_INTERVAL_S": "0.5",
            },
            f"{self.router_url}/readyz",
        )
        port, metrics_port = free_port(), free_port()
        self.buffer_address = f"127.0.0.1:{port}"
        self._spawn(
            "buffer",
            {
                "MILES_BUFFER_REDIS_URL": redis_url,
                "MILES_BUFFER_PORT": str(port),
                "MILES_BUFFER_METRICS_PORT": str(metrics_port),
                "MILES_BUFFER_POLL_INTERVAL_S": "0.05",
            },
            f"http://127.0.0.1:{metrics_port}/readyz",
        )
        port = free_port()
        self.session_url = f"http://127.0.0.1:{port}"
        self._spawn(
            "session",
            {
                "MILES_SESSION_PORT": str(port),
                "MILES_SESSION_REDIS_URL": redis_url,
                "MILES_SESSION_UPSTREAM_URL": self.router_url,
                "MILES_SESSION_OPERATOR_TOKEN": OPERATOR_TOKEN,
                "MILES_SESSION_DEFAULT_MODEL_PATH": str(model),
            },
            f"{self.session_url}/readyz",
        )
        for process in self.processes:
            assert process.ready_url is not None
            wait_for_http_ready(process.ready_url, 120, process.process)

    def _spawn(self, name: str, env: dict[str, str], ready_url: str) -> None:
        script = {"router": "miles-rollout-router", "buffer": "miles-buffer", "session": "miles-session-server"}
        env = {**env, f"MILES_{name.upper()}_LOG_JSON": "false"}
        process = ServiceProcess(
            [console_script(script[name])], ready_url=None, env=env, log_path=self.log_dir / f"{name}.log"
        )
        process.ready_url = ready_url
        self.processes.append(process.start())

    def services(self) -> SharedServices:
        return SharedServices(
            redis_url=self.redis_url,
            router_url=self.router_url,
            router_admin_address="",
            session_url=self.session_url,
            session_operator_token=OPERATOR_TOKEN,
            buffer_address=self.buffer_address,
            sandbox_address="",
            sandbox_http_url="",
        )

    def register_job(self, job_id: str) -> None:
        """What the controller does before backend.start: session-server and buffer job configs."""
        body = {
            "model_path": str(self.model),
            "model_family": "qwen3",
            "engine_pool": job_id,
            "chat_template_kwargs": {"enable_thinking": False},
            "sampling_defaults": {},
        }
        response = httpx.put(
            f"{self.session_url}/v1/jobs/{job_id}/config",
            json=body,
            headers={"authorization": f"Bearer {OPERATOR_TOKEN}"},
            timeout=60,
        )
        assert response.status_code == 200, response.text

        async def configure() -> None:
            from miles.buffer.client import BufferClient

            async with BufferClient(self.buffer_address) as client:
                await client.configure_job(job_id, capacity_groups=0, stale_policy="drop")

        private_loop = asyncio.new_event_loop()  # asyncio.run would unset the test's current loop
        try:
            private_loop.run_until_complete(configure())
        finally:
            private_loop.close()

    def pool_engines(self, job_id: str) -> dict[str, dict[str, Any]]:
        response = httpx.get(f"{self.router_url}/admin/v1/engines", params={"pool": job_id}, timeout=30)
        if response.status_code == 404:
            return {}
        assert response.status_code == 200, response.text
        return {engine["url"]: engine for engine in response.json()["engines"]}

    def stop(self) -> None:
        for process in self.processes:
            process.stop()


@pytest.fixture(scope="module")
def shared(redis_server: RedisServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Shared]:
    import redis

    redis_url = redis_server.url.rsplit("/", 1)[0] + f"/{REDIS_DB}"
    client = redis.Redis.from_url(redis_url)
    client.flushdb()
    client.close()
    running = Shared(tmp_path_factory.mktemp("shared"), redis_url, model_dir(tmp_path_factory.mktemp("model")))
    yield running
    running.stop()


def job_spec(model: Path, **overrides: Any) -> JobSpec:
    rollout = {
        "dataset": {"path": str(REPO_ROOT / "examples/math_single_turn/data.jsonl"), "num_epochs": 100},
        "agent": {"function": "math_single_turn.agent:agent", "python_path": [str(REPO_ROOT / "examples")]},
        # A reward with variance whatever the (fake) model answers: all-equal groups carry no signal and the
        # trainer's dynamic sampling would wait for informative ones forever.
        "reward": {
            "type": "function",
            "function": "e2e_rollout_agents:token_parity_reward",
            "python_path": [str(REPO_ROOT / "tests")],
        },
        "n_samples_per_prompt": 2,
        "request_kwargs": {"temperature": 1.0, "max_tokens": 8},
        "concurrency": {"max_live_episodes": 4},
    }
    data: dict[str, Any] = {
        "model": {"path": str(model), "chat_template_kwargs": {"enable_thinking": False}},
        "rollout": rollout,
        "train": {"num_steps": 2, "batch_size_groups": 2, "mode": "async", "max_staleness": 2, "pull_wait_s": 1},
        "resources": {"engines": {"replicas": 1, "extra_args": ["--fake-model"]}},
    }
    data.update(overrides)
    return JobSpec.model_validate(data)


def run(coro: Any) -> Any:
    return asyncio.get_event_loop().run_until_complete(coro)


@pytest.fixture
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    event_loop = asyncio.new_event_loop()
    asyncio.set_event_loop(event_loop)
    yield event_loop
    event_loop.close()


def wait_for(
    backend: LocalJobBackend, job_id: str, spec: JobSpec, done: Callable[[JobProgress], bool], timeout_s: float = 240
) -> JobProgress:
    """Observe until `done` (a generous ceiling only so that a hang shows the logs instead of the suite timeout)."""
    deadline = time.monotonic() + timeout_s
    while True:
        progress: JobProgress = run(backend.observe(job_id, spec))
        if done(progress):
            return progress
        if time.monotonic() > deadline:
            logs = {p.name: p.read_text()[-1500:] for p in backend.job_dir(job_id).glob("*.log")}
            raise AssertionError(f"last progress {progress}; logs: {json.dumps(logs, indent=1)}")
        time.sleep(0.5)


def assert_all_gone(pids: dict[str, int]) -> None:
    for name, pid in pids.items():
        assert proc_start_time(pid) is None, f"{name} (pid {pid}) still runs"


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
