"""Fixtures of the cross-service tests: the whole rollout stack as real subprocesses on free loopback ports.

`stack` (module-scoped) starts, in parallel where they do not depend on each other: engine(s) (`miles-engine`,
the tiny Qwen3 model or `--fake-model`), the rollout router (engines statically in pool `default`), the session
server, the buffer and the sandbox gateway, all over one Redis database of the test session's redis-server
(a database of its own, flushed at start). A module picks what it needs by overriding the `stack_options`
fixture. `Stack` exposes every URL and helpers to register a job, start rollout workers and read what reached
the buffer, so the controller's end-to-end tests can reuse it.

Nothing here is faked: every part is the real service, talking over real sockets.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import httpx
import pytest
import redis
import yaml

from miles.common.testing import RedisServer, ServiceProcess, free_port, wait_for_http_ready
from miles.common.testing.smoke import console_script

REPO_ROOT = Path(__file__).resolve().parents[1]
OPERATOR_TOKEN = "stack-operator-" + "t" * 32
STACK_REDIS_DB = 9


def _stop_all(processes: list[ServiceProcess]) -> None:
    """SIGTERM every process first, then wait for each (stopping them one by one adds up their grace times)."""
    for process in processes:
        if process.is_running():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGTERM)
    for process in processes:
        process.stop()


@dataclass(frozen=True)
class StackOptions:
    """What a test module needs from the stack."""

    engine: Literal["tiny", "fake"] = "fake"
    """`tiny`: the real tiny Qwen3 model (torch); `fake`: `--fake-model` (hash sampler, no torch)."""
    num_engines: int = 1
    deterministic: bool = False
    """`--deterministic` on real engines: decode logprobs equal prefill logprobs bit for bit."""
    engine_args: tuple[str, ...] = ()
    sandbox: bool = True
    router_env: dict[str, str] = field(default_factory=dict)


def tiny_model_dir(tmp_root: Path) -> Path:
    """`make tiny-model`'s output when present, else built into tmp_root (a few seconds)."""
    made = REPO_ROOT / ".miles" / "models" / "tiny-qwen3"
    if (made / "model.safetensors").is_file():
        return made
    from miles.engine.tiny_model import build_tiny_model

    return Path(build_tiny_model(tmp_root / "tiny-qwen3"))


DEMO_WARMUP_SCRIPTS = {
    "reasoning-demo": "examples/reasoning_gym/warmup.py",
    "harbor-demo": "examples/harbor_tasks/warmup.py",
}
"""Demo models built by running their example's warmup.py as a script (examples/reasoning_gym must not shadow the
reasoning_gym package; examples/harbor_tasks is no package); the calculator demo's by calculator_tool.warmup."""


def demo_model_dir(name: str, tmp_root: Path) -> Path:
    """A demo's warmed-up tiny model: `make run`'s copy (.miles/models/<name>) when present, else built into
    tmp_root once for every test worker sharing tmp_root (~1-3 min alone; CI saw 9 min when each of 4 workers on
    2 cores built its own). The build holds a file lock and renames a finished copy into place, so no worker
    reads a half-written one; never built into the repository."""
    made = REPO_ROOT / ".miles" / "models" / name
    if (made / "model.safetensors").is_file():
        return made
    out = tmp_root / name
    tmp_root.mkdir(parents=True, exist_ok=True)
    with (tmp_root / f"{name}.lock").open("w") as lock_file:
        fcntl.flock(lock_file, fcntl.LOCK_EX)
        if not (out / "model.safetensors").is_file():
            building = tmp_root / f"{name}.building"
            shutil.rmtree(building, ignore_errors=True)
            build_demo_model(name, building)
            building.rename(out)
    return out


def build_demo_model(name: str, out: Path) -> None:
    """Run the demo's warm-up script (a subprocess: it trains for minutes) into `out`."""
    if name in DEMO_WARMUP_SCRIPTS:
        subprocess.run([sys.executable, str(REPO_ROOT / DEMO_WARMUP_SCRIPTS[name]), str(out)], check=True)
    else:
        code = "import sys; from calculator_tool.warmup import build_demo_model; build_demo_model(sys.argv[1])"
        subprocess.run([sys.executable, "-c", code, str(out)], check=True, cwd=REPO_ROOT / "examples")


@pytest.fixture(scope="session")
def demo_model(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """`demo_model(name)`: demo_model_dir in the temp directory all of this run's test workers share (under
    xdist, each worker's base temp directory is a child of it)."""
    base = tmp_path_factory.getbasetemp()
    shared = base.parent / "demo-models" if os.environ.get("PYTEST_XDIST_WORKER") else base / "demo-models"
    return lambda name: demo_model_dir(name, shared)


def demo_job_on_its_first_prompts(num_prompts: int, dataset: Path) -> dict[str, Any]:
    """The `make run` demo's job spec (examples/calculator_tool/job.yaml, as a dict) training on the first
    `num_prompts` prompts of its dataset only (written to `dataset`, cycled): an e2e learning test whose steps each
    draw `num_prompts` groups then sees the same prompts every step, so its reward (or KL) by step measures the
    policy, not which prompts a step drew (the prompts' spread is larger than a few steps' learning). Its timeouts
    are raised far above what an episode needs."""
    spec: dict[str, Any] = yaml.safe_load((REPO_ROOT / "examples" / "calculator_tool" / "job.yaml").read_text())
    rows = (REPO_ROOT / spec["rollout"]["dataset"]["path"]).read_text().splitlines()[:num_prompts]
    dataset.write_text("\n".join(rows) + "\n")
    spec["rollout"]["dataset"]["path"] = str(dataset)
    # Hang guards, not speed limits: on a loaded machine (CI: 4 test workers on 2 cores) the demo's 120 s episode
    # and 5 s tool timeouts cut the long episodes (those that used the tool: the good ones) out of the batch.
    spec["rollout"]["agent"]["timeout_s"] = 900
    spec["rollout"]["agent"]["config"]["tool_timeout_s"] = 60
    return spec


@pytest.fixture
def demo_job_on_first_prompts(tmp_path: Path) -> Callable[[int], dict[str, Any]]:
    """`demo_job_on_first_prompts(n)`: demo_job_on_its_first_prompts with its dataset in the test's tmp_path."""
    return lambda num_prompts: demo_job_on_its_first_prompts(num_prompts, tmp_path / "first-prompts.jsonl")


@dataclass
class WorkerProcess:
    """A `miles-rollout-worker` subprocess of the stack (restartable: same port, id and config)."""

    process: ServiceProcess
    url: str

    def start(self) -> WorkerProcess:
        self.process.start()
        return self

    def kill9(self) -> None:
        self.process.kill9()

    def stop(self) -> int | None:
        return self.process.stop()

    def status(self) -> dict[str, Any]:
        return dict(httpx.get(f"{self.url}/v1/status", timeout=30).json())

    def metrics(self) -> str:
        return httpx.get(f"{self.url}/metrics", timeout=30).text

    def log_tail(self) -> str:
        return self.process.log_tail()


@dataclass
class Stack:
    """The running services. URLs are http://127.0.0.1:<port>; gRPC addresses are 127.0.0.1:<port>."""

    options: StackOptions
    log_dir: Path
    redis_url: str
    model_dir: Path
    operator_token: str = OPERATOR_TOKEN
    processes: dict[str, ServiceProcess] = field(default_factory=dict)
    engine_urls: list[str] = field(default_factory=list)
    router_url: str = ""
    session_url: str = ""
    session_port: int = 0
    buffer_address: str = ""
    buffer_metrics_url: str = ""
    sandbox_address: str = ""
    sandbox_http_url: str = ""
    workers: list[WorkerProcess] = field(default_factory=list)

    # --- lifecycle ---------------------------------------------------------------------------------------------
    def _spawn(self, name: str, argv: list[str], env: dict[str, str], ready_url: str) -> ServiceProcess:
        process = ServiceProcess(argv, ready_url=None, env=env, log_path=self.log_dir / f"{name}.log", cwd=REPO_ROOT)
        process.ready_url = ready_url
        self.processes[name] = process.start()
        return process

    def _wait_ready(self, names: list[str], timeout_s: float = 180.0) -> None:
        for name in names:
            process = self.processes[name]
            assert process.ready_url is not None
            try:
                wait_for_http_ready(process.ready_url, timeout_s, process.process)
            except (RuntimeError, TimeoutError) as exc:
                raise RuntimeError(f"{name}: {exc}\n--- {process.log_path} ---\n{process.log_tail()}") from None

    def start(self) -> Stack:
        first = [*self._start_engines(), self._start_buffer()]
        if self.options.sandbox:
            first.append(self._start_sandbox())
        self._wait_ready([name for name in first if name.startswith("engine")])
        self._start_router()
        self._wait_ready(["router"])
        self._start_session_server()
        self._wait_ready([*first, "session"])
        return self

    def stop_workers(self) -> None:
        _stop_all([worker.process for worker in self.workers])
        self.workers.clear()

    def stop(self) -> None:
        self.stop_workers()
        _stop_all(list(self.processes.values()))

    def _start_engines(self) -> list[str]:
        names = []
        for index in range(self.options.num_engines):
            port = free_port()
            argv = [console_script("miles-engine"), "--model-path", str(self.model_dir), "--port", str(port)]
            if self.options.engine == "fake":
                argv.append("--fake-model")
            if self.options.deterministic:
                argv.append("--deterministic")
            argv += list(self.options.engine_args)
            url = f"http://127.0.0.1:{port}"
            self._spawn(f"engine-{index}", argv, {"MILES_ENGINE_LOG_JSON": "false"}, f"{url}/readyz")
            self.engine_urls.append(url)
            names.append(f"engine-{index}")
        return names

    def _start_router(self) -> None:
        port = free_port()
        self.router_url = f"http://127.0.0.1:{port}"
        env = {
            "MILES_ROUTER_PORT": str(port),
            "MILES_ROUTER_ADMIN_GRPC_PORT": "-1",
            "MILES_ROUTER_STATIC_ENGINES": json.dumps({"default": self.engine_urls}),
            "MILES_ROUTER_HEALTH_CHECK_INTERVAL_S": "0.5",
            "MILES_ROUTER_VERSION_POLL_INTERVAL_S": "0.5",
            "MILES_ROUTER_LOG_JSON": "false",
            **self.options.router_env,
        }
        self._spawn("router", [console_script("miles-rollout-router")], env, f"{self.router_url}/readyz")

    def _start_session_server(self) -> None:
        self.session_port = self.session_port or free_port()
        self.session_url = f"http://127.0.0.1:{self.session_port}"
        env = {
            "MILES_SESSION_PORT": str(self.session_port),
            "MILES_SESSION_REDIS_URL": self.redis_url,
            "MILES_SESSION_UPSTREAM_URL": self.router_url,
            "MILES_SESSION_OPERATOR_TOKEN": self.operator_token,
            "MILES_SESSION_DEFAULT_MODEL_PATH": str(self.model_dir),
            "MILES_SESSION_DEFAULT_MODEL_FAMILY": "qwen3",
            "MILES_SESSION_LOG_JSON": "false",
        }
        self._spawn("session", [console_script("miles-session-server")], env, f"{self.session_url}/readyz")

    def _start_buffer(self) -> str:
        port, metrics_port = free_port(), free_port()
        self.buffer_address = f"127.0.0.1:{port}"
        self.buffer_metrics_url = f"http://127.0.0.1:{metrics_port}"
        env = {
            "MILES_BUFFER_REDIS_URL": self.redis_url,
            "MILES_BUFFER_PORT": str(port),
            "MILES_BUFFER_METRICS_PORT": str(metrics_port),
            "MILES_BUFFER_POLL_INTERVAL_S": "0.05",
            "MILES_BUFFER_LOG_JSON": "false",
        }
        self._spawn("buffer", [console_script("miles-buffer")], env, f"{self.buffer_metrics_url}/readyz")
        return "buffer"

    def _start_sandbox(self) -> str:
        port, http_port = free_port(), free_port()
        self.sandbox_address = f"127.0.0.1:{port}"
        self.sandbox_http_url = f"http://127.0.0.1:{http_port}"
        env = {
            "MILES_SANDBOX_PORT": str(port),
            "MILES_SANDBOX_METRICS_PORT": str(http_port),
            "MILES_SANDBOX_STATE_DIR": str(self.log_dir / "sandbox-state"),
            "MILES_SANDBOX_WARM_POOL_SIZE": "2",
            "MILES_SANDBOX_LOG_JSON": "false",
        }
        self._spawn("sandbox", [console_script("miles-sandbox-gateway")], env, f"{self.sandbox_http_url}/readyz")
        return "sandbox"

    def restart_session_server(self, *, kill: bool = True) -> None:
        """Kill -9 (or stop) the session server and start it again on the same port (sessions live in Redis)."""
        process = self.processes.pop("session")
        if kill:
            process.kill9()
        else:
            process.stop()
        self._start_session_server()
        self._wait_ready(["session"])

    def kill_session_server(self) -> None:
        self.processes["session"].kill9()

    def start_session_server_again(self) -> None:
        self.processes.pop("session")
        self._start_session_server()
        self._wait_ready(["session"])

    # --- jobs --------------------------------------------------------------------------------------------------
    def shared_services(self, **changes: Any) -> Any:
        """The `SharedServices` a controller would hand its backend for this stack (no router admin gRPC: engines
        register over HTTP); `changes` sets other fields (e.g. `shared_pools`)."""
        from miles.controller.backends.base import SharedServices

        return SharedServices(
            self.redis_url,
            self.router_url,
            "",
            self.session_url,
            self.operator_token,
            self.buffer_address,
            self.sandbox_address,
            self.sandbox_http_url,
            **changes,
        )

    def register_job(
        self,
        job_id: str,
        *,
        engine_pool: str = "default",
        sampling_defaults: dict[str, Any] | None = None,
        capacity_groups: int = 0,
        stale_policy: Literal["drop", "requeue"] = "drop",
        model_path: Path | None = None,
    ) -> None:
        """What the controller does for a job: the session server's job config and the buffer's job config."""
        body = {
            "model_path": str(model_path or self.model_dir),
            "model_family": "qwen3",
            "engine_pool": engine_pool,
            "chat_template_kwargs": {"enable_thinking": False},
            "sampling_defaults": sampling_defaults or {},
        }
        headers = {"authorization": f"Bearer {self.operator_token}"}
        response = httpx.put(f"{self.session_url}/v1/jobs/{job_id}/config", json=body, headers=headers, timeout=60)
        assert response.status_code == 200, response.text

        async def configure() -> None:
            from miles.buffer.client import BufferClient

            async with BufferClient(self.buffer_address) as client:
                await client.configure_job(job_id, capacity_groups=capacity_groups, stale_policy=stale_policy)

        asyncio.run(configure())

    def worker(
        self,
        job_id: str,
        rollout: dict[str, Any],
        *,
        worker_id: str = "worker-0",
        env: dict[str, str] | None = None,
        name: str | None = None,
    ) -> WorkerProcess:
        """A `miles-rollout-worker` for the job (not started; `.start()` waits for /readyz). Stopped by the stack."""
        port = free_port()
        label = name or f"worker-{job_id}-{worker_id}"
        config_path = self.log_dir / f"{label}.json"
        config_path.write_text(json.dumps({"rollout": rollout}))
        worker_env = {
            "MILES_ROLLOUT_PORT": str(port),
            "MILES_ROLLOUT_JOB_ID": job_id,
            "MILES_ROLLOUT_WORKER_ID": worker_id,
            "MILES_ROLLOUT_CONFIG_FILE": str(config_path),
            "MILES_ROLLOUT_REDIS_URL": self.redis_url,
            "MILES_ROLLOUT_SESSION_SERVER_URL": self.session_url,
            "MILES_ROLLOUT_SESSION_OPERATOR_TOKEN": self.operator_token,
            "MILES_ROLLOUT_BUFFER_ADDRESS": self.buffer_address,
            "MILES_ROLLOUT_SANDBOX_ADDRESS": self.sandbox_address,
            "MILES_ROLLOUT_SANDBOX_HTTP_URL": self.sandbox_http_url,
            "MILES_ROLLOUT_LOG_JSON": "false",
            **(env or {}),
        }
        process = ServiceProcess(
            [console_script("miles-rollout-worker")],
            ready_url=f"http://127.0.0.1:{port}/readyz",
            env=worker_env,
            log_path=self.log_dir / f"{label}.log",
            cwd=REPO_ROOT,
        )
        worker = WorkerProcess(process, f"http://127.0.0.1:{port}")
        self.workers.append(worker)
        return worker

    # --- observation -------------------------------------------------------------------------------------------
    def live_sessions(self, job_id: str) -> list[str]:
        headers = {"authorization": f"Bearer {self.operator_token}"}
        response = httpx.get(f"{self.session_url}/v1/sessions", params={"job_id": job_id}, headers=headers, timeout=30)
        assert response.status_code == 200, response.text
        return list(response.json()["session_ids"])

    def buffer_stats(self, job_id: str) -> Any:
        async def stats() -> Any:
            from miles.buffer.client import BufferClient

            async with BufferClient(self.buffer_address) as client:
                return await client.stats(job_id)

        return asyncio.run(stats())

    def take_groups(self, job_id: str, max_groups: int = 4096) -> list[Any]:
        """Pulls (and acks) every queued group of the job: what a trainer would train on, each exactly once."""

        async def take() -> list[Any]:
            from miles.buffer.client import BufferClient

            taken: list[Any] = []
            async with BufferClient(self.buffer_address) as client:
                while len(taken) < max_groups:
                    batch = await client.pull_batch(
                        job_id, num_groups=64, trainer_version=0, max_staleness=1_000_000, lease_s=600
                    )
                    if not batch.groups:
                        return taken
                    taken += [leased.group for leased in batch.groups]
                    await client.ack(job_id, [leased.lease_id for leased in batch.groups])
            return taken

        return asyncio.run(take())


@pytest.fixture(autouse=True)
def _stop_rollout_workers_after_test(request: pytest.FixtureRequest) -> Iterator[None]:
    """Workers a test started through `stack.worker` stop when the test ends (the stack lives on)."""
    yield
    if "stack" in request.fixturenames:
        request.getfixturevalue("stack").stop_workers()


@pytest.fixture(scope="session")
def make_stack_options() -> type[StackOptions]:
    """The StackOptions class (test modules cannot import this conftest): override `stack_options` with it."""
    return StackOptions


@pytest.fixture(scope="module")
def stack_options() -> StackOptions:
    """Override in a test module to change the stack (engine kind, number of engines, sandbox)."""
    return StackOptions()


@pytest.fixture(scope="module")
def stack(
    stack_options: StackOptions, redis_server: RedisServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Stack]:
    """The rollout stack for one test module (jobs of different tests stay apart by job id)."""
    redis_url = redis_server.url.rsplit("/", 1)[0] + f"/{STACK_REDIS_DB}"
    client = redis.Redis.from_url(redis_url)
    client.flushdb()
    client.close()
    log_dir = tmp_path_factory.mktemp("stack")
    model_dir = tiny_model_dir(tmp_path_factory.mktemp("models"))
    running = Stack(stack_options, log_dir, redis_url, model_dir)
    try:
        running.start()
        yield running
    finally:
        running.stop()
        if os.environ.get("MILES_KEEP_STACK_LOGS"):
            print(f"stack logs: {log_dir}")
