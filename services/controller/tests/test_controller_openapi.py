"""The controller's published OpenAPI matches what it answers: a bounded schemathesis run over every operation.

The app runs for real (uvicorn in a thread, real Redis, fake backend). Every operation gets generated requests,
positive and negative, mostly authenticated; every answer must be a documented status with a documented media
type and a body and headers as documented, never a 5xx, never a hang (miles.common.testing.openapi_fuzz). One
job that exists (and has ended, so that its SSE stream ends) stands behind some of the generated job ids.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from miles.common.telemetry import Metrics
from miles.common.testing.openapi_fuzz import fuzz_openapi, serve_in_thread
from miles.controller.main import build_service

pytestmark = pytest.mark.integration
MAX_EXAMPLES_PER_OPERATION = 30


@pytest.fixture
def served_controller(redis_url: str, controller_kit: Any) -> Iterator[tuple[str, dict[str, Any]]]:
    """(base URL, OpenAPI document) of a controller served from a background thread."""
    # A key prefix of its own: nothing else on this worker's Redis (another controller's lease) can touch it.
    key_prefix = f"openapi-{uuid.uuid4().hex[:8]}"
    settings_ = controller_kit.make_settings(redis_url, cancel_wait_s=0.5, key_prefix=key_prefix)
    app = build_service(settings_, Metrics("controller"), backend=controller_kit.FakeBackend())
    with serve_in_thread(app) as base_url:
        yield base_url, httpx.get(f"{base_url}/openapi.json").json()


def ended_job(base_url: str, controller_kit: Any) -> str:
    """The id of a job that was submitted and cancelled (terminal: its event stream ends). The fake backend can
    finish the job before the cancel lands, so success ends it too."""
    auth = dict(controller_kit.auth)
    created = httpx.post(f"{base_url}/v1/jobs", json=controller_kit.job_spec_body(), headers=auth).json()
    job_id: str = created["job_id"]
    httpx.post(f"{base_url}/v1/jobs/{job_id}/cancel", headers=auth)
    deadline = time.monotonic() + 60  # seconds on a loaded machine (make test runs tests in parallel)
    record: dict[str, Any] = {}
    while time.monotonic() < deadline:
        record = httpx.get(f"{base_url}/v1/jobs/{job_id}", headers=auth).json()
        if record["state"] in ("SUCCEEDED", "CANCELLED", "FAILED"):
            return job_id
        time.sleep(0.02)
    supervisor_lines = [
        line
        for line in httpx.get(f"{base_url}/metrics").text.splitlines()
        if line.startswith(("miles_controller_supervisor_leader", "miles_controller_supervised_jobs"))
    ]
    raise AssertionError(f"job {job_id} never ended: {record} (supervisor: {supervisor_lines})")


def test_openapi_publishes_every_job_route(served_controller: tuple[str, dict[str, Any]]) -> None:
    _, document = served_controller
    assert set(document["paths"]) == {
        "/healthz",
        "/readyz",
        "/metrics",
        "/v1/jobs",
        "/v1/jobs/{job_id}",
        "/v1/jobs/{job_id}/events",
        "/v1/jobs/{job_id}/evals",
        "/v1/jobs/{job_id}/cancel",
    }
    assert set(document["paths"]["/v1/jobs/{job_id}"]) == {"get", "patch", "delete"}
    assert "HTTPBearer" in document["components"]["securitySchemes"]
    assert "JobSpec" in document["components"]["schemas"]
    events = document["paths"]["/v1/jobs/{job_id}/events"]["get"]["responses"]["200"]["content"]
    assert set(events) == {"text/event-stream"}
    assert document["components"]["schemas"]["TrainConfig"]["properties"]["num_steps"]["minimum"] == 1


def test_every_answer_is_documented(served_controller: tuple[str, dict[str, Any]], controller_kit: Any) -> None:
    base_url, document = served_controller
    report = fuzz_openapi(
        base_url,
        document,
        auth_headers=dict(controller_kit.auth),
        live_path_values={"job_id": [ended_job(base_url, controller_kit)]},
        max_examples=MAX_EXAMPLES_PER_OPERATION,
    )
    report.assert_clean()
    assert len(report.statuses) == 12
    assert {201, 422} <= report.statuses["POST /v1/jobs"]  # valid and invalid specs
    assert {200, 401} <= report.statuses["GET /v1/jobs/{job_id}"]  # the live job, and a missing token
    assert report.media_types["GET /v1/jobs/{job_id}/events"] >= {"text/event-stream"}  # the live job's stream
