"""An httpx client that carries the caller's trace context and request id to the next service, and that does not
lose requests to connection reuse.

Keep-alive ordering: a client must drop an idle pooled connection before the server closes it, or a request sent
on it at that moment fails (`RemoteProtocolError` / `ReadError`, like a dead peer). Every miles server keeps idle
connections `miles.common.serve.SERVER_KEEP_ALIVE_S` (75 s); these clients drop them after
`CLIENT_KEEPALIVE_EXPIRY_S` (30 s). Clients of engines, which may be SGLang (uvicorn's default 5 s), pass
`ENGINE_KEEPALIVE_EXPIRY_S` (2 s). As a second line, an idempotent request (GET, HEAD, OPTIONS, PUT, DELETE) that
fails that way on a reused connection is sent once more on a new one. Limits: a POST is never retried here (it may
have been processed); its caller decides.
"""

from __future__ import annotations

from typing import Any

import httpx

from miles.common.logs import request_id_var
from miles.common.telemetry import inject_context


def propagation_headers() -> dict[str, str]:
    """The headers that carry the current trace context (`traceparent`) and request id to the next service."""
    carrier: dict[str, str] = {}
    inject_context(carrier)
    request_id = request_id_var.get()
    if request_id:
        carrier["x-request-id"] = request_id
    return carrier


async def _inject_headers(request: httpx.Request) -> None:
    for key, value in propagation_headers().items():
        request.headers.setdefault(key, value)


CLIENT_KEEPALIVE_EXPIRY_S = 30.0
"""Idle pooled connections to miles services are dropped after this (below their SERVER_KEEP_ALIVE_S)."""
ENGINE_KEEPALIVE_EXPIRY_S = 2.0
"""Idle pooled connections to engines are dropped after this (below SGLang's uvicorn default of 5 s)."""
IDEMPOTENT_METHODS = frozenset({"GET", "HEAD", "OPTIONS", "PUT", "DELETE"})
_REUSE_FAILURES = (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError)


class RetryIdempotentTransport(httpx.AsyncBaseTransport):
    """Sends an idempotent request once more when its connection broke before any response (a pooled connection
    the server had just closed); everything else passes through."""

    def __init__(self, inner: httpx.AsyncBaseTransport) -> None:
        self.inner = inner

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        try:
            return await self.inner.handle_async_request(request)
        except _REUSE_FAILURES:
            if request.method not in IDEMPOTENT_METHODS:
                raise
            return await self.inner.handle_async_request(request)

    async def aclose(self) -> None:
        await self.inner.aclose()


def traced_async_client(*, keepalive_expiry_s: float = CLIENT_KEEPALIVE_EXPIRY_S, **kwargs: Any) -> httpx.AsyncClient:
    """httpx.AsyncClient whose requests carry `traceparent` and `x-request-id` from the current context, whose idle
    connections expire after `keepalive_expiry_s` (unless `limits` says otherwise) and whose idempotent requests
    survive a pooled connection the server closed."""
    hooks = kwargs.pop("event_hooks", {}) or {}
    request_hooks = [*hooks.get("request", []), _inject_headers]
    if "transport" not in kwargs:
        limits = kwargs.pop("limits", None) or httpx.Limits(keepalive_expiry=keepalive_expiry_s)
        inner = httpx.AsyncHTTPTransport(limits=limits, trust_env=kwargs.get("trust_env", True))
        kwargs["transport"] = RetryIdempotentTransport(inner)
    return httpx.AsyncClient(event_hooks={**hooks, "request": request_hooks}, **kwargs)
