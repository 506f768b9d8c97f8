"""Property-based run (schemathesis) over the controller's published OpenAPI: no input gives a 5xx.

The app runs for real (uvicorn in a thread, real Redis, fake backend); every operation gets a bounded number of
generated requests, authenticated, and the only check is `not_a_server_error`.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error

from miles.common.serve import serve_async
from miles.common.telemetry import Metrics
from miles.common.testing.ports import free_port
from miles.controller.main import build_service

pytestmark = pytest.mark.integration
MAX_EXAMPLES_PER_OPERATION = 25


@pytest.fixture
def served_controller(redis_url: str, controller_kit: Any) -> Iterator[tuple[str, dict[str, Any]]]:
    """(base URL, OpenAPI document) of a controller served from a background thread."""
    settings_ = controller_kit.make_settings(redis_url, cancel_wait_s=0.5)
    app = build_service(settings_, Metrics("controller"), backend=controller_kit.FakeBackend())
    port = free_port()
    loop = asyncio.new_event_loop()
    stop = asyncio.Event()

    def serve() -> None:
        loop.run_until_complete(serve_async(http_app=app, http_port=port, stop_event=stop, handle_signals=False))

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    base_url = f"http://127.0.0.1:{port}"
    for _ in range(500):
        try:
            if httpx.get(f"{base_url}/healthz").status_code == 200:
                break
        except httpx.HTTPError:
            pass
        threading.Event().wait(0.02)
    document = httpx.get(f"{base_url}/openapi.json").json()
    yield base_url, document
    loop.call_soon_threadsafe(stop.set)
    thread.join(timeout=30)
    loop.close()


def test_openapi_publishes_every_job_route(served_controller: tuple[str, dict[str, Any]]) -> None:
    _, document = served_controller
    assert set(document["paths"]) == {
        "/v1/jobs",
        "/v1/jobs/{job_id}",
        "/v1/jobs/{job_id}/events",
        "/v1/jobs/{job_id}/cancel",
    }
    assert set(document["paths"]["/v1/jobs/{job_id}"]) == {"get", "patch", "delete"}
    assert "HTTPBearer" in document["components"]["securitySchemes"]
    assert "JobSpec" in document["components"]["schemas"]


def test_no_generated_request_gets_a_server_error(
    served_controller: tuple[str, dict[str, Any]], controller_kit: Any
) -> None:
    base_url, document = served_controller
    schema = schemathesis.openapi.from_dict(document)
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) == 7
    statuses: dict[str, set[int]] = {}
    for operation in operations:
        strategies = [operation.as_strategy(mode) for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)]
        strategies += operation.get_strategies_from_examples()

        @given(case=st.one_of(strategies))
        @settings(
            max_examples=MAX_EXAMPLES_PER_OPERATION,
            deadline=None,
            suppress_health_check=list(HealthCheck),
            database=None,
        )
        def run(case: schemathesis.Case) -> None:
            response = case.call_and_validate(
                base_url=base_url, headers=dict(controller_kit.auth), checks=[not_a_server_error], timeout=30
            )
            statuses.setdefault(f"{case.method} {case.path}", set()).add(response.status_code)

        run()
    assert len(statuses) == len(operations)
    assert 201 in statuses["POST /v1/jobs"] and 422 in statuses["POST /v1/jobs"]  # valid and invalid specs
    print(statuses)
