"""Metrics (one Prometheus registry per process) and tracing (one OpenTelemetry tracer provider per process).

Metric names follow `miles_<service>_<what>_<unit>`; `Metrics` adds the `miles_<service>_` prefix so that a
service only names what and unit. Labels must be bounded (never a session, request or group id).

Tracing: `setup_tracing(service)` installs an OTLP exporter when OTEL_EXPORTER_OTLP_ENDPOINT is set and
otherwise records nothing, unless a test passes its own exporter (e.g. InMemorySpanExporter). Context crosses
process boundaries as W3C `traceparent` headers (HTTP) and metadata (gRPC); see `inject_context` /
`extract_context`.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, MutableMapping, Sequence

from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor, SpanExporter
from prometheus_client import CONTENT_TYPE_LATEST as PROMETHEUS_CONTENT_TYPE
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

__all__ = [
    "PROMETHEUS_CONTENT_TYPE",
    "Metrics",
    "current_trace_id_hex",
    "extract_context",
    "get_tracer",
    "inject_context",
    "setup_tracing",
]

_NAME_RE = re.compile(r"^[a-z][a-z0-9_]*$")
LATENCY_BUCKETS_S: tuple[float, ...] = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class Metrics:
    """The Prometheus registry of one process, naming every metric `miles_<service>_<what>`.

    Not the global prometheus_client REGISTRY, so that tests can build many services in one process.
    """

    def __init__(self, service: str) -> None:
        if not _NAME_RE.match(service):
            raise ValueError(f"service name {service!r} must match {_NAME_RE.pattern}")
        self.service = service
        self.registry = CollectorRegistry(auto_describe=True)

    def full_name(self, what: str) -> str:
        if not _NAME_RE.match(what):
            raise ValueError(f"metric name {what!r} must match {_NAME_RE.pattern}")
        return f"miles_{self.service}_{what}"

    def counter(self, what: str, documentation: str, labelnames: Sequence[str] = ()) -> Counter:
        """A counter; prometheus_client appends `_total` when exposing, so name it without the suffix."""
        return Counter(self.full_name(what), documentation, labelnames, registry=self.registry)

    def gauge(self, what: str, documentation: str, labelnames: Sequence[str] = ()) -> Gauge:
        return Gauge(self.full_name(what), documentation, labelnames, registry=self.registry)

    def histogram(
        self,
        what: str,
        documentation: str,
        labelnames: Sequence[str] = (),
        buckets: Sequence[float] = LATENCY_BUCKETS_S,
    ) -> Histogram:
        return Histogram(self.full_name(what), documentation, labelnames, registry=self.registry, buckets=buckets)

    def exposition(self) -> bytes:
        """The registry in Prometheus text format."""
        return generate_latest(self.registry)


_tracing_configured_for: str | None = None


def setup_tracing(service: str, exporter: SpanExporter | None = None) -> TracerProvider | None:
    """Install the process's tracer provider once.

    With `exporter` (tests), spans are exported synchronously to it. Without, an OTLP/gRPC exporter is used
    when OTEL_EXPORTER_OTLP_ENDPOINT is set; otherwise no provider is installed and spans are no-ops (cheap).
    Returns the provider installed, or None.
    """
    global _tracing_configured_for
    if _tracing_configured_for is not None:
        provider = trace.get_tracer_provider()
        return provider if isinstance(provider, TracerProvider) else None
    if exporter is None and not os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"):
        return None
    provider = TracerProvider(resource=Resource.create({"service.name": f"miles-{service}"}))
    if exporter is not None:
        provider.add_span_processor(SimpleSpanProcessor(exporter))
    else:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    trace.set_tracer_provider(provider)
    _tracing_configured_for = service
    return provider


def get_tracer(name: str) -> trace.Tracer:
    return trace.get_tracer(name)


def inject_context(carrier: MutableMapping[str, str]) -> MutableMapping[str, str]:
    """Write the current trace context (traceparent/tracestate) into headers or gRPC metadata."""
    propagate.inject(carrier)
    return carrier


def extract_context(carrier: Mapping[str, str]) -> otel_context.Context:
    """The trace context carried by incoming headers or metadata (an empty context when there is none)."""
    return propagate.extract(carrier)


def current_trace_id_hex() -> str:
    """Trace id of the current span as 32 hex chars, or "" when there is no valid span."""
    span_context = trace.get_current_span().get_span_context()
    return format(span_context.trace_id, "032x") if span_context.is_valid else ""
