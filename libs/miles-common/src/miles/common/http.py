"""The FastAPI app factory every HTTP service (and every gRPC service's metrics port) is built with.

`create_http_app` gives an app with:
- `/healthz` (the process is alive) and `/readyz` (every readiness check passes, else 503 naming the failures),
- `/metrics` (the process's Prometheus registry),
- a request id per request (`X-Request-ID`, taken from the caller when present, echoed back, put into logs),
- a server span per request whose parent is the caller's W3C trace context,
- request count and latency metrics per route template (`miles_<service>_http_requests_total`, ...),
- `MilesError` mapped to its HTTP status and a JSON body `{"error": {...}}` (+ `Retry-After` when set), and
  request validation failures mapped to 422 with the field path.
Routes and handlers stay in the service's own transport module; the factory only adds what every service shares.
"""

from __future__ import annotations

import math
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping
from contextlib import AbstractAsyncContextManager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from miles.common.errors import MilesError
from miles.common.logs import request_id_var
from miles.common.telemetry import PROMETHEUS_CONTENT_TYPE, Metrics, extract_context

ReadinessCheck = Callable[[], Awaitable[None]]
"""An async check that raises (any exception) when the service cannot serve yet; its message is reported."""

_PROBE_PATHS = frozenset({"/healthz", "/readyz", "/metrics"})


def error_response(error: MilesError) -> JSONResponse:
    """The HTTP response for a MilesError (used by the app's handler and by streaming code paths)."""
    headers = {}
    if error.retry_after_s is not None:
        headers["Retry-After"] = str(max(1, math.ceil(error.retry_after_s)))
    return JSONResponse({"error": error.to_dict()}, status_code=error.http_status, headers=headers)


def validation_error_response(exc: RequestValidationError) -> JSONResponse:
    """422 naming the first invalid field as a dotted path, with every problem in details."""
    problems = [
        {"field": ".".join(str(part) for part in err.get("loc", ())), "message": err.get("msg", "")}
        for err in exc.errors()
    ]
    first = problems[0] if problems else {"field": "", "message": "invalid request"}
    body = {
        "type": "RequestValidationError",
        "code": "invalid_request",
        "message": f"{first['field']}: {first['message']}",
        "field": first["field"],
        "details": {"errors": problems},
    }
    return JSONResponse({"error": body}, status_code=422)


HTTP_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})
"""Method label values; anything else a client sends is counted as `other` (labels must stay bounded: a client
inventing methods must not grow /metrics)."""


def method_label(method: str) -> str:
    return method if method in HTTP_METHODS else "other"


class _RequestContextMiddleware:
    """Pure ASGI middleware (streaming-safe): request id, server span, request metrics."""

    def __init__(self, app: ASGIApp, metrics: Metrics) -> None:
        self.app = app
        self.tracer = trace.get_tracer("miles.common.http")
        self.requests_total = metrics.counter(
            "http_requests",
            "HTTP requests answered, by method, route template and status",
            ["method", "route", "status"],
        )
        self.request_duration_s = metrics.histogram(
            "http_request_duration_seconds", "Time to the end of the HTTP response, seconds", ["method", "route"]
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {key.decode("latin-1"): value.decode("latin-1") for key, value in scope["headers"]}
        request_id = headers.get("x-request-id") or uuid.uuid4().hex
        token = request_id_var.set(request_id)
        status_code = 500
        start_s = time.perf_counter()

        async def send_with_request_id(message: Message) -> None:
            nonlocal status_code
            if message["type"] == "http.response.start":
                status_code = message["status"]
                message.setdefault("headers", [])
                message["headers"] = [*message["headers"], (b"x-request-id", request_id.encode("latin-1"))]
            await send(message)

        path = scope.get("path", "")
        with self.tracer.start_as_current_span(
            f"{method_label(scope.get('method', 'GET'))} request",
            context=extract_context(headers),
            kind=SpanKind.SERVER,
        ) as span:
            try:
                await self.app(scope, receive, send_with_request_id)
            finally:
                route = getattr(scope.get("route"), "path", None) or "unmatched"
                method = method_label(scope.get("method", ""))
                span.update_name(f"{method} {route}")
                span.set_attribute("http.method", method)
                span.set_attribute("http.route", route)
                span.set_attribute("http.status_code", status_code)
                span.set_attribute("miles.request_id", request_id)
                if status_code >= 500:
                    span.set_status(Status(StatusCode.ERROR))
                if path not in _PROBE_PATHS:
                    self.requests_total.labels(method, route, str(status_code)).inc()
                    self.request_duration_s.labels(method, route).observe(time.perf_counter() - start_s)
                request_id_var.reset(token)


def create_http_app(
    *,
    service: str,
    metrics: Metrics,
    readiness_checks: Mapping[str, ReadinessCheck] | None = None,
    lifespan: Callable[[FastAPI], AbstractAsyncContextManager[Any]] | None = None,
    title: str | None = None,
    version: str = "v1",
) -> FastAPI:
    """A FastAPI app with the probes, metrics, request ids, tracing and error mapping every service shares."""
    # FastAPI's own OpenTelemetry instrumentation is off: our middleware makes exactly one span per request
    # (streaming-safe, with route template and request id) and metrics go to the process's Prometheus registry.
    app = FastAPI(
        title=title or f"miles-{service}",
        version=version,
        lifespan=lifespan,
        telemetry={"tracing": False, "metrics": False, "logs": False, "operation_spans": False},
    )
    checks = dict(readiness_checks or {})
    app.state.metrics = metrics
    app.state.readiness_checks = checks

    @app.get("/healthz", include_in_schema=False)
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/readyz", include_in_schema=False)
    async def readyz(request: Request) -> JSONResponse:
        failures = {}
        for name, check in request.app.state.readiness_checks.items():
            try:
                await check()
            except Exception as exc:  # a readiness check may fail in any way; report, never crash
                failures[name] = f"{type(exc).__name__}: {exc}"
        if failures:
            return JSONResponse({"status": "not ready", "failures": failures}, status_code=503)
        return JSONResponse({"status": "ready"})

    @app.get("/metrics", include_in_schema=False)
    async def metrics_endpoint() -> Response:
        return Response(metrics.exposition(), media_type=PROMETHEUS_CONTENT_TYPE)

    @app.exception_handler(MilesError)
    async def handle_miles_error(_: Request, exc: MilesError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def handle_validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        return validation_error_response(exc)

    app.add_middleware(_RequestContextMiddleware, metrics=metrics)
    return app
