"""Acceptance: the demo job with evaluation every 5 versions on its own engines, through the controller's REST API.

A real `miles-controller` process (local backend) over the `stack`'s shared services runs the `make run` demo job
(`examples/calculator_tool/job.yaml`: its warmed-up tiny model, calculator tool in the sandbox) cut to NUM_STEPS
steps, with `evaluation: {every_n_versions: 5}` on 8 prompts of the demo's dataset. The rollout worker evaluates
each due version it sees served (0, then 5) with sessions pinned to it.

Checked: while the job runs, `miles status` prints the scores of version 0; the job SUCCEEDS; `GET
/v1/jobs/{id}/evals` holds version 0 scored (each of its 8 episodes either kept, every turn served at version 0, or
discarded because the engines moved to version 1 during it: the job trains asynchronously) and version 5 (scored,
or `missed` when the trainer outran it), nothing at the versions that are not due; the job's event stream carries
an `eval` event; a scored version 5 reports its step-to-score time (from the trainer's step), at least its lag
(from the worker's sighting). A run: v0 reward 0.00 over 6 kept episodes (2 discarded, lag 9.0 s), v5 reward 1.00
over 4 (4 discarded, lag 7.0 s); another: v5 lag 7.8 s, 9.1 s after its step.

About 2-3 minutes on 2 shared cores.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from miles.common.testing import ServiceProcess, free_port
from miles.common.testing.smoke import console_script

pytestmark = [pytest.mark.e2e, pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(1200)]

REPO_ROOT = Path(__file__).resolve().parents[1]
API_TOKEN = "e2e-eval-token-" + "x" * 16
NUM_STEPS = 8


@pytest.fixture(scope="module")
def stack_options(make_stack_options: Any) -> Any:
    return make_stack_options(engine="fake", num_engines=0, sandbox=True)


def demo_with_evaluation(model: Path) -> dict[str, Any]:
    spec: dict[str, Any] = yaml.safe_load((REPO_ROOT / "examples" / "calculator_tool" / "job.yaml").read_text())
    spec["model"]["path"] = str(model)
    spec["train"].update(num_steps=NUM_STEPS, batch_size_groups=2, checkpoint_interval_steps=NUM_STEPS)
    held = {"path": "examples/calculator_tool/data.jsonl"}
    spec["evaluation"] = {"datasets": [{"name": "held", "dataset": held, "limit": 8}], "every_n_versions": 5}
    return spec


def test_the_demo_job_is_scored_per_version_in_the_api_and_miles_status(
    stack: Any, tmp_path: Path, demo_model: Callable[[str], Path]
) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {
        "MILES_CONTROLLER_PORT": str(port),
        "MILES_CONTROLLER_API_TOKENS": API_TOKEN,
        "MILES_CONTROLLER_REDIS_URL": stack.redis_url,
        "MILES_CONTROLLER_ROUTER_URL": stack.router_url,
        "MILES_CONTROLLER_SESSION_URL": stack.session_url,
        "MILES_CONTROLLER_SESSION_OPERATOR_TOKEN": stack.operator_token,
        "MILES_CONTROLLER_BUFFER_ADDRESS": stack.buffer_address,
        "MILES_CONTROLLER_SANDBOX_ADDRESS": stack.sandbox_address,
        "MILES_CONTROLLER_SANDBOX_HTTP_URL": stack.sandbox_http_url,
        "MILES_CONTROLLER_STATE_DIR": str(tmp_path / "state"),
        "MILES_CONTROLLER_OBSERVE_INTERVAL_S": "0.5",
        "MILES_CONTROLLER_LOCAL_OPTIONS": json.dumps({"cwd": str(REPO_ROOT), "restart_backoff_initial_s": 0.5}),
        "MILES_CONTROLLER_LOG_JSON": "false",
    }
    headers = {"authorization": f"Bearer {API_TOKEN}"}
    controller = ServiceProcess(
        [console_script("miles-controller")],
        ready_url=f"{url}/readyz",
        env=env,
        log_path=tmp_path / "c.log",
        cwd=REPO_ROOT,
    )
    with controller, httpx.Client(base_url=url, headers=headers, timeout=60) as client:
        submitted = client.post("/v1/jobs", json=demo_with_evaluation(demo_model("calculator-demo")))
        assert submitted.status_code == 201, submitted.text
        job_id = submitted.json()["job_id"]
        status_output = ""
        deadline = time.monotonic() + 900
        while True:
            job = client.get(f"/v1/jobs/{job_id}").json()
            evals = client.get(f"/v1/jobs/{job_id}/evals").json()["evals"]
            if not status_output and any(e["version"] == 0 for e in evals) and job["state"] == "RUNNING":
                cli_env = {**os.environ, "MILES_CONTROLLER_URL": url, "MILES_API_TOKEN": API_TOKEN}
                done = subprocess.run(
                    [console_script("miles"), "status", "--home", str(tmp_path / "home")],
                    env=cli_env,
                    capture_output=True,
                    text=True,
                    timeout=60,
                    check=False,
                )
                status_output = done.stdout + done.stderr
            if job["state"] in ("SUCCEEDED", "FAILED", "CANCELLED") or time.monotonic() > deadline:
                break
            time.sleep(1.0)
        logs = {p.name: p.read_text(errors="replace")[-1500:] for p in (tmp_path / "state").rglob("*.log")}
        assert job["state"] == "SUCCEEDED", f"{json.dumps(job)[:2000]}\n{json.dumps(logs, indent=1)}"
        evals = {e["version"]: e for e in client.get(f"/v1/jobs/{job_id}/evals").json()["evals"]}
        events = client.get(f"/v1/jobs/{job_id}/events", headers={"accept": "text/event-stream"}).text
    print(f"evals: {json.dumps(evals)[:1500]}\nmiles status:\n{status_output}")
    assert set(evals) <= {0, 5} and 0 in evals, evals
    baseline = evals[0]["datasets"]["held"]
    assert evals[0]["status"] == "scored", evals[0]
    # Async training moves the engines to version 1 while version 0 is evaluated: the episodes that met it are
    # discarded, the others count; none is lost and none is scored at another version.
    assert baseline["num_episodes"] >= 1 and baseline["num_episodes"] + baseline["num_discarded"] == 8, baseline
    assert evals.get(5, {"status": "scored"})["status"] in ("scored", "missed")
    assert evals[0]["step_to_score_s"] is None  # the initial weights: no trainer step made them
    if evals.get(5, {}).get("status") == "scored":  # the trainer's step ended before any engine served version 5
        assert evals[5]["step_to_score_s"] is not None and evals[5]["step_to_score_s"] >= evals[5]["lag_s"], evals[5]
    assert "eval v0: held reward" in status_output, status_output
    assert "event: eval" in events, events[-2000:]
