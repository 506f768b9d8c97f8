"""Real shared services (Redis DB, router, buffer, session server) and a small math job for the local backend's
tests (test code; this folder is put on sys.path by conftest.py)."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from miles.common.jobspec.job import JobSpec
from miles.common.testing import RedisServer, ServiceProcess, free_port, wait_for_http_ready
from miles.common.testing.smoke import console_script
from miles.controller.backends.base import JobProgress, SharedServices
from miles.controller.backends.local import LocalJobBackend
from miles.controller.backends.local_processes import proc_start_time

REPO_ROOT = Path(__file__).resolve().parents[3]
OPERATOR_TOKEN = "local-backend-operator-" + "t" * 24


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


def start_shared(redis_server: RedisServer, log_dir: Path, model_root: Path, db: int) -> Shared:
    """Shared services over DB `db` of the session's Redis (flushed first)."""
    import redis

    redis_url = redis_server.url.rsplit("/", 1)[0] + f"/{db}"
    client = redis.Redis.from_url(redis_url)
    client.flushdb()
    client.close()
    return Shared(log_dir, redis_url, model_dir(model_root))
