"""The session server's published OpenAPI matches what it answers: a bounded schemathesis run over every operation.

The service runs for real (uvicorn in a thread, real Redis, the scripted SGLang-protocol engine upstream). Every
operation gets generated requests, positive and negative, mostly with the operator token; every answer must be
a documented status with a documented media type and a body and headers as documented, never a 5xx, never a hang
(miles.common.testing.openapi_fuzz). A live session and a registered job stand behind some of the generated ids.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from miles.common.telemetry import Metrics
from miles.common.testing.openapi_fuzz import fuzz_openapi, serve_in_thread
from miles.session.main import build_service
from miles.session.settings import SessionSettings

pytestmark = pytest.mark.integration
MAX_EXAMPLES_PER_OPERATION = 30


@pytest.fixture
def served_session_server(
    redis_url: str, scripted_engine: Any, qwen3_model_dir: Path, shared_models: Any, operator_token: str
) -> Iterator[tuple[str, dict[str, Any]]]:
    """(base URL, OpenAPI document) of a session server served from a background thread."""
    settings = SessionSettings(
        store_backend="redis",
        redis_url=redis_url,
        upstream_url=scripted_engine.url,
        operator_token=operator_token,
        default_model_path=str(qwen3_model_dir),
        default_model_family="qwen3",
        max_ttl_s=3600.0,
    )
    app = build_service(settings, Metrics("session"), models=shared_models)
    with serve_in_thread(app) as base_url:
        yield base_url, httpx.get(f"{base_url}/openapi.json").json()


def test_every_answer_is_documented(
    served_session_server: tuple[str, dict[str, Any]], operator_token: str, qwen3_model_dir: Path
) -> None:
    base_url, document = served_session_server
    auth = {"authorization": f"Bearer {operator_token}"}
    config = {"model_path": str(qwen3_model_dir), "model_family": "qwen3"}
    assert httpx.put(f"{base_url}/v1/jobs/job-live/config", json=config, headers=auth).status_code == 200
    created = httpx.post(f"{base_url}/v1/sessions", json={"job_id": "job-live"}, headers=auth).json()
    report = fuzz_openapi(
        base_url,
        document,
        auth_headers=auth,
        live_path_values={"session_id": [created["session_id"]], "job_id": ["job-live"]},
        max_examples=MAX_EXAMPLES_PER_OPERATION,
    )
    report.assert_clean()
    chat = "POST /v1/sessions/{session_id}/v1/chat/completions"
    assert {200, 401, 404} <= report.statuses[chat]  # a live session's turn, no token, an unknown session
    assert "application/json" in report.media_types[chat]
    # A streamed turn, sent explicitly: whether the generator draws `stream: true` depends on hypothesis's pool of
    # literals from the modules loaded, which changes with the tests that ran before.
    documented = document["paths"]["/v1/sessions/{session_id}/v1/chat/completions"]["post"]["responses"]["200"]
    body = {"model": "policy", "messages": [{"role": "user", "content": "Hi"}], "stream": True, "max_tokens": 4}
    fresh = httpx.post(f"{base_url}/v1/sessions", json={"job_id": "job-live"}, headers=auth).json()  # fuzz deleted
    turn = f"{base_url}/v1/sessions/{fresh['session_id']}/v1/chat/completions"
    streamed = httpx.post(turn, json=body, headers={"authorization": f"Bearer {fresh['token']}"}, timeout=60)
    assert streamed.status_code == 200 and streamed.headers["content-type"].startswith("text/event-stream")
    assert "text/event-stream" in documented["content"] and streamed.text.rstrip().endswith("data: [DONE]")
    assert {200, 201, 422} <= report.statuses["POST /v1/sessions"]  # an Idempotency-Key replay, a create, a bad body
