"""Prometheus metrics of TITO comparisons, registered on the service's own `Metrics` registry.

`miles_session_tito_mismatch_total{kind}`: mismatches found by the comparator, per kind (every kind is exported
from the start, at 0). `miles_session_tito_comparisons_total{result}`: compared sessions by worst outcome
(`clean`, `non_critical`, `critical`). Labels are bounded; never a session id.
"""

from __future__ import annotations

from prometheus_client import Counter

from miles.common.telemetry import Metrics
from miles.session.tito.comparator import ComparisonResult, MismatchKind

COMPARISON_RESULTS: tuple[str, ...] = ("clean", "non_critical", "critical")


class TitoMetrics:
    """The TITO counters of one registry; `record` a comparison result once per compared session."""

    def __init__(self, metrics: Metrics) -> None:
        self.mismatches: Counter = metrics.counter(
            "tito_mismatch", "TITO token sequence mismatches against a fresh render, by kind", ["kind"]
        )
        self.comparisons: Counter = metrics.counter(
            "tito_comparisons", "TITO sessions compared against a fresh render, by worst outcome", ["result"]
        )
        for kind in MismatchKind:
            self.mismatches.labels(kind=kind.value)
        for result in COMPARISON_RESULTS:
            self.comparisons.labels(result=result)

    def record(self, result: ComparisonResult) -> None:
        for mismatch in result.mismatches:
            self.mismatches.labels(kind=mismatch.kind.value).inc()
        if result.num_critical:
            outcome = "critical"
        elif result.mismatches:
            outcome = "non_critical"
        else:
            outcome = "clean"
        self.comparisons.labels(result=outcome).inc()


def register_tito_metrics(metrics: Metrics) -> TitoMetrics:
    """Register the TITO counters on `metrics` (the session-server's `Metrics("session")`); call once."""
    return TitoMetrics(metrics)
