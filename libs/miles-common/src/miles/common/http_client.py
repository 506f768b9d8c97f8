"""An httpx client that carries the caller's trace context and request id to the next service."""

from __future__ import annotations

from typing import Any

import httpx

from miles.common.logs import request_id_var
from miles.common.telemetry import inject_context


async def _inject_headers(request: httpx.Request) -> None:
    carrier: dict[str, str] = {}
    inject_context(carrier)
    for key, value in carrier.items():
        request.headers.setdefault(key, value)
    request_id = request_id_var.get()
    if request_id:
        request.headers.setdefault("x-request-id", request_id)


def traced_async_client(**kwargs: Any) -> httpx.AsyncClient:
    """httpx.AsyncClient whose requests carry `traceparent` and `x-request-id` from the current context."""
    hooks = kwargs.pop("event_hooks", {}) or {}
    request_hooks = [*hooks.get("request", []), _inject_headers]
    return httpx.AsyncClient(event_hooks={**hooks, "request": request_hooks}, **kwargs)
