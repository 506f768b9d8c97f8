"""The HTTP app factory: probes, metrics, request ids, error mapping and trace propagation."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator

import httpx
import pytest
from fastapi import FastAPI
from opentelemetry import trace
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from pydantic import BaseModel, Field

from miles.common.errors import NotFoundError, UnavailableError
from miles.common.http import create_http_app
from miles.common.http_client import traced_async_client
from miles.common.logs import JsonFormatter
from miles.common.serve import serve_async
from miles.common.telemetry import Metrics, current_trace_id_hex
from miles.common.testing import free_port


class Item(BaseModel):
    name: str = Field(min_length=1)
    count: int = Field(ge=0)


def make_app(ready: dict[str, bool]) -> FastAPI:
    async def dependency_check() -> None:
        if not ready["ok"]:
            raise ConnectionError("redis unreachable")

    app = create_http_app(service="demo", metrics=Metrics("demo"), readiness_checks={"redis": dependency_check})

    @app.post("/v1/items")
    async def create_item(item: Item) -> dict[str, object]:
        return {"name": item.name, "trace_id": current_trace_id_hex()}

    @app.get("/v1/items/{item_id}")
    async def get_item(item_id: str) -> dict[str, str]:
        if item_id == "busy":
            raise UnavailableError("engine pool is restarting", retry_after_s=2.5)
        raise NotFoundError(f"item {item_id!r} does not exist", field="item_id")

    return app


@pytest.fixture
async def client() -> AsyncIterator[tuple[httpx.AsyncClient, dict[str, bool]]]:
    ready = {"ok": True}
    transport = httpx.ASGITransport(app=make_app(ready))
    async with httpx.AsyncClient(transport=transport, base_url="http://demo") as http:
        yield http, ready


async def test_probes_and_readiness_failure_names_the_check(client: tuple[httpx.AsyncClient, dict[str, bool]]) -> None:
    http, ready = client
    assert (await http.get("/healthz")).json() == {"status": "ok"}
    assert (await http.get("/readyz")).status_code == 200
    ready["ok"] = False
    not_ready = await http.get("/readyz")
    assert not_ready.status_code == 503
    assert not_ready.json()["failures"] == {"redis": "ConnectionError: redis unreachable"}


async def test_miles_error_maps_to_status_with_json_body(client: tuple[httpx.AsyncClient, dict[str, bool]]) -> None:
    http, _ = client
    missing = await http.get("/v1/items/abc")
    busy = await http.get("/v1/items/busy")
    assert missing.status_code == 404
    assert missing.json()["error"] == {
        "type": "NotFoundError",
        "code": "not_found",
        "message": "item 'abc' does not exist",
        "field": "item_id",
    }
    assert busy.status_code == 503
    assert busy.headers["retry-after"] == "3"


async def test_validation_error_is_422_naming_the_field(client: tuple[httpx.AsyncClient, dict[str, bool]]) -> None:
    http, _ = client
    response = await http.post("/v1/items", json={"name": "x", "count": -1})
    assert response.status_code == 422
    assert response.json()["error"]["field"] == "body.count"


async def test_request_id_echoed_and_generated(client: tuple[httpx.AsyncClient, dict[str, bool]]) -> None:
    http, _ = client
    given = await http.get("/healthz", headers={"X-Request-ID": "req-123"})
    generated = await http.get("/healthz")
    assert given.headers["x-request-id"] == "req-123"
    assert len(generated.headers["x-request-id"]) == 32


async def test_metrics_count_requests_by_route_template(client: tuple[httpx.AsyncClient, dict[str, bool]]) -> None:
    http, _ = client
    await http.get("/v1/items/a")
    await http.get("/v1/items/b")
    exposition = (await http.get("/metrics")).text
    assert 'miles_demo_http_requests_total{method="GET",route="/v1/items/{item_id}",status="404"} 2.0' in exposition
    assert 'route="/healthz"' not in exposition


async def test_junk_methods_and_paths_do_not_grow_the_metrics(
    client: tuple[httpx.AsyncClient, dict[str, bool]],
) -> None:
    """Label values stay bounded whatever clients send: invented methods count as `other`, unknown paths as the
    `unmatched` route, so 2,000 junk requests add no series after the first few."""
    http, _ = client

    def series(exposition: str) -> set[str]:
        return {line.split(" ")[0] for line in exposition.splitlines() if line.startswith("miles_demo_http_")}

    await http.request("BREW", "/v1/items/warm-up")
    await http.get("/nowhere/warm-up")
    before = series((await http.get("/metrics")).text)
    for index in range(1000):
        await http.request(f"X{index}", f"/v1/items/{index}")
        await http.request("GET", f"/junk/{index}/path")
    after = series((await http.get("/metrics")).text)
    assert after == before, sorted(after - before)[:10]
    exposition = (await http.get("/metrics")).text
    assert 'method="other"' in exposition and 'route="unmatched"' in exposition
    assert "X999" not in exposition and "junk" not in exposition


async def test_trace_context_crosses_a_real_http_hop(span_exporter: InMemorySpanExporter) -> None:
    port = free_port()
    started, stop = asyncio.Event(), asyncio.Event()
    server_task = asyncio.create_task(
        serve_async(
            http_app=make_app({"ok": True}),
            http_port=port,
            grace_s=1,
            on_started=lambda *_: started.set(),
            stop_event=stop,
            handle_signals=False,
        )
    )
    await asyncio.wait_for(started.wait(), timeout=30)
    tracer = trace.get_tracer("test-client")
    try:
        async with traced_async_client(base_url=f"http://127.0.0.1:{port}") as http:
            with tracer.start_as_current_span("caller") as caller:
                response = await http.post("/v1/items", json={"name": "a", "count": 1})
    finally:
        stop.set()
        await asyncio.wait_for(server_task, timeout=30)
    caller_trace_id = format(caller.get_span_context().trace_id, "032x")
    assert response.json()["trace_id"] == caller_trace_id
    server_spans = [s for s in span_exporter.get_finished_spans() if s.name == "POST /v1/items"]
    assert len(server_spans) == 1
    assert server_spans[0].parent is not None
    assert server_spans[0].parent.span_id == caller.get_span_context().span_id


def test_json_log_line_carries_trace_id_and_extras(span_exporter: InMemorySpanExporter) -> None:
    formatter = JsonFormatter("demo")
    tracer = trace.get_tracer("test")
    with tracer.start_as_current_span("work") as span:
        record = logging.LogRecord("miles.demo", logging.INFO, __file__, 1, "pushed %d groups", (3,), None)
        record.job_id = "job-1"
        line = json.loads(formatter.format(record))
    assert line["msg"] == "pushed 3 groups"
    assert line["job_id"] == "job-1"
    assert line["service"] == "demo"
    assert line["trace_id"] == format(span.get_span_context().trace_id, "032x")
