"""miles-rollout-worker starts as a real process and serves the probes every service must serve; a job whose
agent cannot be imported stops it at start-up with a message naming the problem."""

import json
import subprocess
from pathlib import Path

import httpx
import pytest

from miles.common.testing import ServiceProcess, free_port
from miles.common.testing.smoke import check_service_entrypoint, console_script


@pytest.mark.integration
def test_rollout_entrypoint_serves_probes(tmp_path: Path) -> None:
    metrics = check_service_entrypoint("miles-rollout-worker", "MILES_ROLLOUT_", tmp_path, grpc_service=False)
    assert "# TYPE miles_rollout_" in metrics


@pytest.mark.integration
def test_an_idle_worker_reports_no_job(tmp_path: Path) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {"MILES_ROLLOUT_PORT": str(port)}
    with ServiceProcess([console_script("miles-rollout-worker")], ready_url=f"{url}/readyz", env=env,
                        log_path=tmp_path / "worker.log"):  # fmt: skip
        assert httpx.get(f"{url}/v1/status").json() == {"job_id": "", "idle": True}


@pytest.mark.integration
def test_an_agent_that_cannot_be_imported_stops_the_worker_at_start(tmp_path: Path) -> None:
    dataset = tmp_path / "d.jsonl"
    dataset.write_text('{"prompt": "hi"}\n')
    config = tmp_path / "rollout.json"
    section = {"dataset": {"path": str(dataset)}, "agent": {"function": "no_such_agent_module:agent"}}
    config.write_text(json.dumps({"job_id": "job-x", "rollout": section}))
    env = {"MILES_ROLLOUT_CONFIG_FILE": str(config), "MILES_ROLLOUT_PORT": str(free_port()), "PATH": "/usr/bin:/bin"}
    result = subprocess.run([console_script("miles-rollout-worker")], env=env, capture_output=True, text=True,
                            timeout=120, check=False)  # fmt: skip
    assert result.returncode != 0
    assert "cannot import rollout.agent.function module 'no_such_agent_module'" in result.stderr
