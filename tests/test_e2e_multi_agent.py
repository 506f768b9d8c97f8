"""Acceptance: multi-agent episodes end to end. The `examples/solver_verifier` job (roles solver and verifier, a
reward per role), shortened, is registered by the controller's own client (session-server job config with the
roles, buffer queue) and run on the local backend: its engine, rollout worker, weight-sync and trainer are real
processes over the `stack`'s shared services (Redis, router, session server, buffer).

Checked: the session server stored the job's roles; the trainer's step metrics (what the controller reads as the
job's progress) count samples of both roles in the batches it trained, one of each per episode; the job reaches
its last step and weight version; no session of the job is left.

The model is the calculator demo's (`make run`'s copy, else built here, ~3 min): a tiny model that is seldom right
but writes a number in some replies and nothing in others, so the example's credit for a wrong number gives the
solver's rewards variance within a group (the trainer discards groups without signal in every role). This test is
about the roles reaching the trainer, not about learning.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from miles.common.jobspec.job import JobSpec
from miles.controller.backends.base import JobProgress, SharedServices
from miles.controller.backends.local import LocalJobBackend
from miles.controller.shared import SharedServicesClient

pytestmark = [pytest.mark.e2e, pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(1200)]

REPO_ROOT = Path(__file__).resolve().parents[1]
JOB_ID = "multi-agent"
ROLES = ["solver", "verifier"]
NUM_STEPS = 2


@pytest.fixture(scope="module")
def stack_options(make_stack_options: Any) -> Any:
    return make_stack_options(engine="fake", num_engines=0, sandbox=False)


def short_job(model: Path) -> JobSpec:
    """The example's job spec, cut to NUM_STEPS steps of one small group each."""
    spec: dict[str, Any] = yaml.safe_load((REPO_ROOT / "examples" / "solver_verifier" / "job.yaml").read_text())
    assert spec["rollout"]["roles"] == ROLES
    spec["model"]["path"] = str(model)
    spec["rollout"].update(n_samples_per_prompt=4, concurrency={"max_live_episodes": 8})
    spec["rollout"]["request_kwargs"]["max_tokens"] = 16
    spec["train"].update(num_steps=NUM_STEPS, batch_size_groups=1, max_staleness=2, checkpoint_interval_steps=NUM_STEPS)
    return JobSpec.model_validate(spec)


def role_metrics(metrics: dict[str, float]) -> dict[str, float]:
    return {key: value for key, value in metrics.items() if "/role=" in key}


def run_until_done(
    loop: asyncio.AbstractEventLoop, backend: LocalJobBackend, spec: JobSpec
) -> tuple[JobProgress, list[dict[str, float]]]:
    """The final progress, and the per-role step metrics of every observation that had any."""
    seen: list[dict[str, float]] = []
    deadline = time.monotonic() + 900  # a ceiling only, so that a hang shows the logs
    while True:
        progress: JobProgress = loop.run_until_complete(backend.observe(JOB_ID, spec))
        if role_metrics(progress.metrics):
            seen.append(role_metrics(progress.metrics))
        if progress.phase in ("succeeded", "failed"):
            return progress, seen
        if time.monotonic() > deadline:
            logs = {p.name: p.read_text()[-2000:] for p in backend.job_dir(JOB_ID).glob("*.log")}
            raise AssertionError(f"last progress {progress}; logs: {json.dumps(logs, indent=1)}")
        time.sleep(0.5)


def test_the_solver_verifier_job_trains_on_samples_of_both_roles(
    stack: Any, tmp_path: Path, demo_model: Callable[[str], Path]
) -> None:
    spec = short_job(demo_model("calculator-demo"))
    services = SharedServices(
        stack.redis_url, stack.router_url, "", stack.session_url, stack.operator_token, stack.buffer_address, "", ""
    )
    loop = asyncio.new_event_loop()
    shared = SharedServicesClient(services, timeout_s=60)
    backend = LocalJobBackend(services, tmp_path / "state", cwd=REPO_ROOT, restart_backoff_initial_s=0.2)
    try:
        loop.run_until_complete(shared.register(JOB_ID, spec))
        headers = {"authorization": f"Bearer {stack.operator_token}"}
        config = httpx.get(f"{stack.session_url}/v1/jobs/{JOB_ID}/config", headers=headers, timeout=30).json()
        assert (config["roles"], config["tree_sessions"]) == (ROLES, False), config

        loop.run_until_complete(backend.start(JOB_ID, spec))
        progress, seen = run_until_done(loop, backend, spec)
        assert progress.phase == "succeeded", progress
        assert progress.step == NUM_STEPS and progress.weight_version == NUM_STEPS, progress
    finally:
        loop.run_until_complete(backend.stop(JOB_ID))
        loop.run_until_complete(backend.close())
        loop.run_until_complete(shared.close())
        loop.close()

    assert seen, "the trainer never reported per-role step metrics: no sample with a role reached it"
    for metrics in seen:
        num_solver, num_verifier = metrics["num_samples/role=solver"], metrics["num_samples/role=verifier"]
        assert num_solver == num_verifier == 4.0, metrics  # one group of 4 episodes, a sample per role each
        assert 0.0 <= metrics["reward_mean/role=solver"] <= 1.0 and 0.0 <= metrics["reward_mean/role=verifier"] <= 1.0
    deadline = time.monotonic() + 30
    while stack.live_sessions(JOB_ID) and time.monotonic() < deadline:  # deletions of the stopped worker
        time.sleep(0.5)
    assert stack.live_sessions(JOB_ID) == []
