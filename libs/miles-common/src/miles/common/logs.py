"""Structured logging: one JSON object per line on stderr, with service, request and trace ids attached.

Call `configure_logging(service, level)` once in main(). Log with the standard library and pass structured
fields through `extra` (`log.info("group pushed", extra={"job_id": job_id, "num_samples": 8})`).
"""

from __future__ import annotations

import contextvars
import json
import logging
import sys
import time
from typing import Any

from opentelemetry import trace

request_id_var: contextvars.ContextVar[str | None] = contextvars.ContextVar("miles_request_id", default=None)

# Attributes every LogRecord has; anything else on a record came from `extra` and is emitted as a field.
_RECORD_ATTRIBUTES = frozenset(vars(logging.makeLogRecord({}))) | {"message", "asctime", "taskName"}


class JsonFormatter(logging.Formatter):
    """Formats a record as JSON with ts, level, logger, msg, service, request_id, trace_id, span_id and extras."""

    def __init__(self, service: str) -> None:
        super().__init__()
        self.service = service

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
            "service": self.service,
        }
        request_id = request_id_var.get()
        if request_id:
            entry["request_id"] = request_id
        span_context = trace.get_current_span().get_span_context()
        if span_context.is_valid:
            entry["trace_id"] = format(span_context.trace_id, "032x")
            entry["span_id"] = format(span_context.span_id, "016x")
        for key, value in vars(record).items():
            if key not in _RECORD_ATTRIBUTES and not key.startswith("_"):
                entry[key] = value
        if record.exc_info:
            entry["exc_info"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


def configure_logging(service: str, level: str = "INFO", *, json_lines: bool = True) -> None:
    """Route every logger to stderr in the chosen format; replaces handlers configured before."""
    handler = logging.StreamHandler(sys.stderr)
    if json_lines:
        handler.setFormatter(JsonFormatter(service))
    else:
        handler.setFormatter(logging.Formatter(f"%(asctime)s {service} %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    # uvicorn installs its own handlers; let its records flow to ours instead.
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        logging.getLogger(name).handlers[:] = []
        logging.getLogger(name).propagate = True
    # httpx logs every request it sends at INFO ("HTTP Request: POST ..."): one line per proxied turn in the router
    # and the session server. Structured logs carry no per-request INFO lines; at DEBUG they are still there.
    numeric = logging.getLevelName(level.upper())
    client_level = numeric if isinstance(numeric, int) and numeric <= logging.DEBUG else logging.WARNING
    for name in ("httpx", "httpcore"):
        logging.getLogger(name).setLevel(client_level)
