"""The FastAPI app factory every HTTP service (and every gRPC service's metrics port) is built with.

`create_http_app` gives an app with:
- `/healthz` (the process is alive) and `/readyz` (every readiness check passes, else 503 naming the failures),
- `/metrics` (the process's Prometheus registry),
- a request id per request (`X-Request-ID`, taken from the caller when present, echoed back, put into logs),
- 422 for a path holding an encoded `/` (which routing would decode into another path),
- a server span per request whose parent is the caller's W3C trace context,
- request count and latency metrics per route template (`miles_<service>_http_requests_total`, ...),
- `MilesError` mapped to its HTTP status and a JSON body `{"error": {...}}` (+ `Retry-After` when set),
  request validation failures mapped to 422 with the field path, and the router's own answers (no route for the
  path: 404, a method the path does not take: 405) given the same body,
- an OpenAPI document that says so: the probes with their real media types, every error answer of every operation
  with the `Error` body schema (FastAPI's default 422 schema, a shape never sent, is replaced), `X-Request-ID` on
  every answer and `Retry-After` on 429 / 503.
Routes and handlers stay in the service's own transport module; the factory only adds what every service shares.
Each service still documents the statuses its own routes answer (`responses=` on the route).
"""

from __future__ import annotations

import json
import math
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping, Sequence
from contextlib import AbstractAsyncContextManager
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode
from pydantic import BaseModel, Field
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from miles.common.errors import MilesError
from miles.common.logs import request_id_var
from miles.common.telemetry import PROMETHEUS_CONTENT_TYPE, Metrics, extract_context

ReadinessCheck = Callable[[], Awaitable[None]]
"""An async check that raises (any exception) when the service cannot serve yet; its message is reported."""

_PROBE_PATHS = frozenset({"/healthz", "/readyz", "/metrics"})
ERROR_SCHEMA_NAME = "Error"
ERROR_SCHEMA: dict[str, Any] = {
    "title": ERROR_SCHEMA_NAME,
    "description": "The body of every error answer (a MilesError, a request validation failure, no such route)",
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["type", "code", "message"],
            "properties": {
                "type": {"type": "string", "description": "Error class, e.g. SessionNotFoundError"},
                "code": {"type": "string", "description": "Stable machine-readable code, e.g. not_found"},
                "message": {"type": "string", "description": "What went wrong and how to fix it"},
                "field": {"type": "string", "description": "The offending input field, as a dotted path"},
                "retry_after_s": {"type": "number", "description": "When a retry may succeed (also Retry-After)"},
                "details": {"type": "object", "description": "Error-specific facts (validation: every problem)"},
            },
        }
    },
}
"""JSON schema of the `{"error": {...}}` body (`MilesError.to_dict`, `validation_error_response`)."""
_ERROR_CONTENT: dict[str, Any] = {"application/json": {"schema": {"$ref": f"#/components/schemas/{ERROR_SCHEMA_NAME}"}}}
_REQUEST_ID_HEADER: dict[str, Any] = {
    "description": "The request id (the caller's X-Request-ID when sent, else a new one), also in the logs",
    "required": True,
    "schema": {"type": "string"},
}
_RETRY_AFTER_HEADER: dict[str, Any] = {
    "description": "Seconds after which a retry may succeed (sent when the error knows)",
    "schema": {"type": "integer", "minimum": 1},
}
_FASTAPI_VALIDATION_SCHEMAS = ("HTTPValidationError", "ValidationError")
_ROUTER_ERROR_CODES = {404: "not_found", 405: "method_not_allowed"}
_FASTAPI_BODY_PARSE_DETAIL = "There was an error parsing the body"
NO_SLASH_PATTERN = "^[^/]+$"
"""Stated for every string path parameter without a pattern of its own: a `/` in one is refused (422)."""


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


def _invalid_request(field: str, message: str) -> JSONResponse:
    """The 422 of a request the router refuses before any route runs (same body as `validation_error_response`)."""
    body = {
        "type": "RequestValidationError",
        "code": "invalid_request",
        "message": f"{field}: {message}",
        "field": field,
        "details": {"errors": [{"field": field, "message": message}]},
    }
    return JSONResponse({"error": body}, status_code=422)


def router_error_response(exc: StarletteHTTPException) -> JSONResponse:
    """The router's own answers (no route for a path: 404; a method the path does not take: 405) as `Error`.

    FastAPI answers a JSON body that is not UTF-8 text with a bare 400; it becomes the 422 of every other body
    that is not JSON (`json_invalid`), so that a route has one status for "not a valid body"."""
    if exc.status_code == 400 and exc.detail == _FASTAPI_BODY_PARSE_DETAIL:
        return _invalid_request("body", "the body is not JSON text (UTF-8)")
    code = _ROUTER_ERROR_CODES.get(exc.status_code, f"http_{exc.status_code}")
    body = {"type": "HTTPException", "code": code, "message": str(exc.detail)}
    return JSONResponse({"error": body}, status_code=exc.status_code, headers=exc.headers)


def encoded_slash_response() -> JSONResponse:
    """422 for a path holding an encoded `/` (%2F). The router would decode it and match the request against another
    route (a 404 or 405 for the wrong reason, or another operation); no miles path parameter holds a `/`."""
    return _invalid_request("path", "a path parameter holds an encoded '/' (%2F); no id contains '/'")


class HealthStatus(BaseModel):
    status: Literal["ok"] = Field(description="The process is alive")


class Readiness(BaseModel):
    status: Literal["ready", "not ready"]
    failures: dict[str, str] = Field(
        default_factory=dict, description="Readiness check name -> why it failed (present when not ready)"
    )


PROBE_RESPONSES: dict[int | str, dict[str, Any]] = {
    503: {"model": Readiness, "description": "A readiness check failed; `failures` names each and says why"}
}
METRICS_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {
        "description": "The process's metrics in the Prometheus text exposition format",
        "content": {"text/plain": {"schema": {"type": "string"}}},
    }
}


def _is_error_status(status: str) -> bool:
    return status == "default" or status[:1] in ("4", "5")


def _drop_null_option(schema: dict[str, Any]) -> None:
    """`str | None = None` parameters: FastAPI's schema says `anyOf: [string, null]`, but a header, query or path
    value is text, never JSON null (an absent one is `required: false`), and "null" is no absent value."""
    options = schema.get("anyOf")
    if not isinstance(options, list):
        return
    kept = [option for option in options if option.get("type") != "null"]
    if len(kept) == len(options) or not kept:
        return
    if len(kept) > 1:
        schema["anyOf"] = kept
        return
    del schema["anyOf"]
    for key, value in kept[0].items():
        schema.setdefault(key, value)


def document_shared_answers(document: dict[str, Any]) -> dict[str, Any]:
    """Complete an app's OpenAPI document (in place) with what the factory adds to every route: the `Error` body of
    every error answer (replacing FastAPI's HTTPValidationError, which this app never sends), `X-Request-ID` on
    every answer and `Retry-After` on 429 / 503; and parameters without FastAPI's JSON-null option."""
    schemas = document.setdefault("components", {}).setdefault("schemas", {})
    schemas[ERROR_SCHEMA_NAME] = ERROR_SCHEMA
    for path_item in document.get("paths", {}).values():
        for operation in path_item.values():
            if not isinstance(operation, dict):
                continue
            for parameter in operation.get("parameters", []):
                schema = parameter.get("schema", {})
                _drop_null_option(schema)
                if parameter.get("in") == "path" and schema.get("type") == "string":
                    schema.setdefault("pattern", NO_SLASH_PATTERN)  # the request-context middleware's 422
            for status, response in operation.get("responses", {}).items():
                headers = response.setdefault("headers", {})
                headers.setdefault("X-Request-ID", _REQUEST_ID_HEADER)
                if status in ("429", "503"):
                    headers.setdefault("Retry-After", _RETRY_AFTER_HEADER)
                if not _is_error_status(status):
                    continue
                content = response.get("content")
                if content is None or "HTTPValidationError" in str(content):
                    response["content"] = _ERROR_CONTENT
                if status == "422" and response.get("description") == "Validation Error":
                    response["description"] = "The request breaks the schema; `field` names the first problem"
    for name in _FASTAPI_VALIDATION_SCHEMAS:  # in this order: ValidationError is referenced by HTTPValidationError
        if name in schemas and f'"#/components/schemas/{name}"' not in json.dumps(document):
            del schemas[name]
    return document


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
                if b"%2f" in scope.get("raw_path", b"").lower():
                    await encoded_slash_response()(scope, receive, send_with_request_id)
                else:
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
    openapi_hooks: Sequence[Callable[[dict[str, Any]], None]] = (),
) -> FastAPI:
    """A FastAPI app with the probes, metrics, request ids, tracing and error mapping every service shares.

    `openapi_hooks` complete the generated OpenAPI document in place (once, after the shared answers are added):
    for what pydantic cannot say, e.g. a bound that comes from the service's settings."""
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

    @app.get("/healthz", tags=["probes"], summary="Liveness: the process answers")
    async def healthz() -> HealthStatus:
        return HealthStatus(status="ok")

    @app.get(
        "/readyz",
        tags=["probes"],
        response_model=Readiness,
        responses=PROBE_RESPONSES,
        summary="Readiness: every dependency check passes",
    )
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

    @app.get(
        "/metrics",
        tags=["probes"],
        response_class=Response,
        responses=METRICS_RESPONSES,
        summary="Prometheus metrics of the process",
    )
    async def metrics_endpoint() -> Response:
        return Response(metrics.exposition(), media_type=PROMETHEUS_CONTENT_TYPE)

    @app.exception_handler(MilesError)
    async def handle_miles_error(_: Request, exc: MilesError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def handle_validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        return validation_error_response(exc)

    @app.exception_handler(StarletteHTTPException)
    async def handle_router_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return router_error_response(exc)

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            document = document_shared_answers(FastAPI.openapi(app))
            for hook in openapi_hooks:
                hook(document)
            app.openapi_schema = document
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
    app.add_middleware(_RequestContextMiddleware, metrics=metrics)
    return app
