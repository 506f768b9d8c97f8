"""Acceptance: shortened jobs through the controller's REST API with the local backend, end to end.

The shared services are the real ones of the `stack` fixture (Redis, router, session server, buffer; no engines of
its own: every job brings its engine pool). A real `miles-controller` process runs the local backend, which
starts each job's engines (`--fake-model`, cheap), weight-sync, rollout worker and trainer (the real tiny Qwen3
on the CPU) as processes of their own.

Two jobs run at once: A (a few steps) and B (long, to be cancelled). Checked: the state machine PENDING ->
RUNNING -> SUCCEEDED of A as seen by GET and by the SSE stream (resumed with Last-Event-ID after a controller
crash, no event repeated); the jobs' engines sit in separate router pools and their processes are distinct;
kill -9 of the controller mid-job and a new controller on the same port leave both jobs untouched (no process
started again: same pid and kernel start time of every process) and both keep training; A's new weights reach
its engine and A succeeds after its last step with its processes stopped and its pool empty; B grows to two engines
through `PATCH`; cancelling B gives CANCELLED with none of its processes left and its pool empty.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from miles.buffer.client import BufferClient
from miles.common.testing import ServiceProcess, free_port
from miles.common.testing.smoke import console_script
from miles.controller.backends.local_processes import proc_start_time
from miles.proto.buffer.v1 import buffer_pb2

pytestmark = [pytest.mark.e2e, pytest.mark.integration]

REPO_ROOT = Path(__file__).resolve().parents[1]
API_TOKEN = "e2e-controller-token-" + "x" * 16
TERMINAL = {"SUCCEEDED", "FAILED", "CANCELLED"}


@pytest.fixture(scope="module")
def stack_options(make_stack_options: Any) -> Any:
    return make_stack_options(engine="fake", num_engines=0, sandbox=False)


class Controller:
    """A `miles-controller` subprocess on a fixed port (restartable), local backend over the stack."""

    def __init__(self, stack: Any, state_dir: Path, log_dir: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.state_dir = state_dir
        self.log_dir = log_dir
        self.env = {
            "MILES_CONTROLLER_PORT": str(self.port),
            "MILES_CONTROLLER_API_TOKENS": API_TOKEN,
            "MILES_CONTROLLER_REDIS_URL": stack.redis_url,
            "MILES_CONTROLLER_ROUTER_URL": stack.router_url,
            "MILES_CONTROLLER_SESSION_URL": stack.session_url,
            "MILES_CONTROLLER_SESSION_OPERATOR_TOKEN": stack.operator_token,
            "MILES_CONTROLLER_BUFFER_ADDRESS": stack.buffer_address,
            "MILES_CONTROLLER_SANDBOX_ADDRESS": "",
            "MILES_CONTROLLER_STATE_DIR": str(state_dir),
            "MILES_CONTROLLER_OBSERVE_INTERVAL_S": "0.5",
            "MILES_CONTROLLER_LEADER_LEASE_S": "3",
            "MILES_CONTROLLER_LOCAL_OPTIONS": json.dumps(
                {"cwd": str(REPO_ROOT), "restart_backoff_initial_s": 0.5, "stop_grace_s": 10}
            ),
            "MILES_CONTROLLER_LOG_JSON": "false",
        }
        self.process: ServiceProcess | None = None
        self.starts = 0

    def start(self) -> None:
        self.starts += 1
        self.process = ServiceProcess(
            [console_script("miles-controller")],
            ready_url=f"{self.url}/readyz",
            env=self.env,
            log_path=self.log_dir / f"controller-{self.starts}.log",
            cwd=REPO_ROOT,
        ).start()

    def kill9(self) -> None:
        assert self.process is not None
        self.process.kill9()

    def stop(self) -> None:
        if self.process is not None:
            self.process.stop()

    def call(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        headers = {"authorization": f"Bearer {API_TOKEN}", **kwargs.pop("headers", {})}
        return httpx.request(method, f"{self.url}{path}", headers=headers, timeout=60, **kwargs)

    def job(self, job_id: str) -> dict[str, Any]:
        response = self.call("GET", f"/v1/jobs/{job_id}")
        assert response.status_code == 200, response.text
        return dict(response.json())

    def wait_job(self, job_id: str, done: Callable[[dict[str, Any]], bool], timeout_s: float = 300) -> dict[str, Any]:
        """Poll until `done`; a job that ended otherwise fails at once (the ceiling only turns a hang into a readable
        failure with the job's logs)."""
        deadline = time.monotonic() + timeout_s
        while True:
            job = self.job(job_id)
            if done(job):
                return job
            if job["state"] in TERMINAL or time.monotonic() > deadline:
                raise AssertionError(f"job {job_id}: {json.dumps(job)[:3000]}\n{self.job_logs(job_id)}")
            time.sleep(0.5)

    def job_dir(self, job_id: str) -> Path:
        return self.state_dir / "jobs" / job_id

    def job_logs(self, job_id: str) -> str:
        logs = {path.name: path.read_text(errors="replace")[-1500:] for path in self.job_dir(job_id).glob("*.log")}
        assert self.process is not None
        logs["controller"] = self.process.log_tail(3000)
        return json.dumps(logs, indent=1)

    def job_pids(self, job_id: str) -> dict[str, tuple[int, int]]:
        """(pid, kernel start time) of every process the local backend recorded for the job."""
        state = json.loads((self.job_dir(job_id) / "state.json").read_text())
        return {record["name"]: (record["pid"], record["start_time"]) for record in state["processes"]}


def alive(pids: dict[str, tuple[int, int]]) -> dict[str, bool]:
    return {name: proc_start_time(pid) == start for name, (pid, start) in pids.items()}


def kill_leftovers(controller: Controller) -> None:
    """Teardown safety net: per-job processes outlive the controller by design, so a failed test kills them."""
    import os
    import signal

    for state in controller.state_dir.glob("jobs/*/state.json"):
        for record in json.loads(state.read_text())["processes"]:
            if record["pid"] and proc_start_time(record["pid"]) == record["start_time"]:
                os.killpg(record["pid"], signal.SIGKILL)


@pytest.fixture
def controller(stack: Any, tmp_path: Path) -> Iterator[Controller]:
    running = Controller(stack, tmp_path / "state", tmp_path)
    running.start()
    try:
        yield running
    finally:
        running.stop()
        kill_leftovers(running)


def job_body(stack: Any, name: str, num_steps: int) -> dict[str, Any]:
    rollout = {
        "dataset": {"path": "examples/math_single_turn/data.jsonl", "num_epochs": 100},
        "agent": {"function": "math_single_turn.agent:agent", "python_path": ["examples"]},
        "reward": {
            "type": "function",
            "function": "e2e_rollout_agents:token_parity_reward",
            "python_path": [str(REPO_ROOT / "tests")],
        },
        "n_samples_per_prompt": 2,
        "request_kwargs": {"temperature": 1.0, "max_tokens": 8},
        "concurrency": {"max_live_episodes": 4},
    }
    return {
        "name": name,
        "model": {"path": str(stack.model_dir), "chat_template_kwargs": {"enable_thinking": False}},
        "rollout": rollout,
        "train": {"num_steps": num_steps, "batch_size_groups": 2, "max_staleness": 2, "pull_wait_s": 1},
        "weight_sync": {"transport": "stream"},
        "resources": {"engines": {"replicas": 1, "extra_args": ["--fake-model"]}},
    }


class EventReader(threading.Thread):
    """Follows a job's SSE stream in the background; reconnects with Last-Event-ID when the controller dies."""

    def __init__(self, controller: Controller, job_id: str) -> None:
        super().__init__(daemon=True)
        self.controller, self.job_id = controller, job_id
        self.events: list[dict[str, Any]] = []
        self.ids: list[str] = []
        self.reconnects = 0
        self.done = threading.Event()

    def run(self) -> None:
        last_id = ""
        while not self.done.is_set():
            headers = {"authorization": f"Bearer {API_TOKEN}"}
            if last_id:
                headers["Last-Event-ID"] = last_id
            try:
                url = f"{self.controller.url}/v1/jobs/{self.job_id}/events"
                with httpx.stream("GET", url, headers=headers, timeout=httpx.Timeout(60, connect=2)) as response:
                    event_id, event_type = "", ""
                    for line in response.iter_lines():
                        if line.startswith("id: "):
                            event_id = line[4:]
                        elif line.startswith("event: "):
                            event_type = line[7:]
                        elif line.startswith("data: "):
                            self.ids.append(event_id)
                            self.events.append({"type": event_type, **json.loads(line[6:])})
                            last_id = event_id
                if any(state in TERMINAL for state in self.states()):
                    self.done.set()  # the server ends the stream after the terminal state
                    return
            except httpx.HTTPError:
                pass
            self.reconnects += 1  # the controller went away mid-stream
            time.sleep(0.5)

    def states(self) -> list[str]:
        return [event["state"] for event in self.events if event.get("type") == "state"]


def pool_engines(stack: Any, pool: str) -> dict[str, int]:
    """Engine URL -> weight version the router sees, for the engines of one pool."""
    response = httpx.get(f"{stack.router_url}/admin/v1/engines", params={"pool": pool}, timeout=30)
    if response.status_code == 404:
        return {}
    assert response.status_code == 200, response.text
    return {engine["url"]: engine["weight_version"] for engine in response.json()["engines"]}


def pool_stats(stack: Any, pool: str) -> dict[str, Any]:
    response = httpx.get(f"{stack.router_url}/admin/v1/stats", params={"pool": pool}, timeout=30)
    assert response.status_code == 200, response.text
    return dict(response.json())


def wait_until(predicate: Callable[[], bool], what: str, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        time.sleep(0.5)


def buffer_config(stack: Any, job_id: str) -> buffer_pb2.JobBufferConfig:
    async def read() -> buffer_pb2.JobBufferConfig:
        async with BufferClient(stack.buffer_address) as buffer:
            return (await buffer.stats(job_id)).config

    return asyncio.run(read())


@pytest.mark.slow  # two jobs and a controller restart: about two minutes of the 2-core make test
def test_jobs_through_the_rest_api_survive_a_controller_crash(stack: Any, controller: Controller) -> None:
    num_steps_a = 8
    # B (long) first, A (short) once B runs: started together on a loaded machine, A could finish its 8 steps
    # while B was still starting (seen in CI), and A must still run when the controller is killed.
    response = controller.call("POST", "/v1/jobs", json=job_body(stack, "long", num_steps=10_000))
    assert response.status_code == 201, response.text
    job_b = response.json()["job_id"]
    controller.wait_job(job_b, lambda job: job["state"] == "RUNNING" and job["pools"]["engines"]["live"] == 1)
    response = controller.call("POST", "/v1/jobs", json=job_body(stack, "short", num_steps=num_steps_a))
    assert response.status_code == 201, response.text
    job_a = response.json()["job_id"]
    assert response.json()["state"] in ("PENDING", "RUNNING")
    events = EventReader(controller, job_a)
    events.start()
    controller.wait_job(job_a, lambda job: job["state"] == "RUNNING" and job["pools"]["engines"]["live"] == 1)
    pids_a, pids_b = controller.job_pids(job_a), controller.job_pids(job_b)
    # The controller configured A's buffer queue for partial rollout (train.stale_policy mask, the async default).
    assert buffer_config(stack, job_a).stale_policy == buffer_pb2.STALE_POLICY_MASK
    assert set(pids_a) == {"engine-0", "weightsync", "worker-0", "trainer"}
    # Separate engine pools and processes per job (the session server sends a job's sessions to its pool only).
    engines_a, engines_b = set(pool_engines(stack, job_a)), set(pool_engines(stack, job_b))
    assert len(engines_a) == 1 and len(engines_b) == 1 and not engines_a & engines_b
    assert not {pid for pid, _ in pids_a.values()} & {pid for pid, _ in pids_b.values()}

    # The controller dies mid-job; the jobs' processes do not notice. A new controller adopts them: no process is
    # started again (a new start would record a new pid and kernel start time), and both jobs carry on.
    controller.wait_job(job_a, lambda job: job["step"] >= 1)
    for job_id in (job_a, job_b):  # each job's sessions are served by its own pool, i.e. its own engine
        wait_until(lambda job_id=job_id: pool_stats(stack, job_id)["requests_total"] > 0, f"{job_id} generates")
        assert pool_stats(stack, job_id)["num_engines"] == 1
    # New weights reach A's engine (trainer -> weight-sync origin -> engine; the router reads its version).
    wait_until(lambda: max(pool_engines(stack, job_a).values(), default=0) >= 1, "A's engine serves a new version")
    job = controller.job(job_a)
    assert job["state"] == "RUNNING" and job["step"] < num_steps_a, "job A ended before the controller was killed"
    controller.kill9()
    assert all(alive(pids_a).values()) and all(alive(pids_b).values())
    controller.start()
    step_at_kill = job["step"]
    controller.wait_job(job_a, lambda job: job["step"] > step_at_kill)
    assert controller.job_pids(job_a) == pids_a, controller.job_logs(job_a)
    controller.wait_job(job_b, lambda job: job["step"] >= 1)
    assert controller.job_pids(job_b) == pids_b and all(alive(pids_b).values()), controller.job_logs(job_b)

    job = controller.wait_job(job_a, lambda job: job["state"] in TERMINAL)
    assert job["state"] == "SUCCEEDED", controller.job_logs(job_a)
    assert job["step"] == num_steps_a and job["weight_version"] == num_steps_a
    assert controller.job_pids(job_a) == pids_a
    assert not any(alive(pids_a).values())  # a finished job's processes are stopped
    assert pool_engines(stack, job_a) == {}
    events.join(timeout=60)
    assert events.states() == ["PENDING", "RUNNING", "SUCCEEDED"], events.events
    assert events.reconnects >= 1 and len(set(events.ids)) == len(events.ids)  # resumed, nothing repeated
    assert max(event.get("step", 0) for event in events.events) >= 1

    # B still runs, untouched by A's end; it grows to two engines while it runs (both in its pool).
    assert all(alive(pids_b).values()) and set(pool_engines(stack, job_b)) == engines_b
    response = controller.call("PATCH", f"/v1/jobs/{job_b}", json={"engines": 2})
    assert response.status_code == 202, response.text
    controller.wait_job(job_b, lambda job: job["pools"]["engines"]["live"] == 2)
    wait_until(lambda: len(pool_engines(stack, job_b)) == 2, "B's second engine joins its pool")
    assert engines_b < set(pool_engines(stack, job_b))
    pids_b = controller.job_pids(job_b)

    # Cancelled, B ends with none of its processes left.
    response = controller.call("POST", f"/v1/jobs/{job_b}/cancel")
    assert response.status_code in (200, 202), response.text
    job = controller.wait_job(job_b, lambda job: job["state"] in TERMINAL)
    assert job["state"] == "CANCELLED"
    assert not any(alive(pids_b).values())
    assert pool_engines(stack, job_b) == {}
