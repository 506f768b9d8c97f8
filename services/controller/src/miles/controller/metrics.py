"""Prometheus metrics of the controller (`miles_controller_*`); labels are bounded (state, operation, outcome)."""

from __future__ import annotations

from miles.common.telemetry import Metrics

BACKEND_OPERATIONS = ("start", "observe", "resize", "stop", "register")


class ControllerMetrics:
    def __init__(self, metrics: Metrics) -> None:
        self.jobs_submitted = metrics.counter("jobs_submitted", "Jobs accepted by POST /v1/jobs (replays excluded)")
        self.jobs_ended = metrics.counter("jobs_ended", "Jobs that reached a terminal state, by state", ["state"])
        self.active_jobs = metrics.gauge("active_jobs", "Jobs PENDING, QUEUED or RUNNING (as seen by the supervisor)")
        self.supervised_jobs = metrics.gauge("supervised_jobs", "Jobs this replica supervises now")
        self.is_leader = metrics.gauge("supervisor_leader", "1 while this replica holds the supervisor lease")
        self.backend_calls = metrics.counter(
            "backend_calls",
            "Backend and registration calls, by operation and outcome (ok, error)",
            ["operation", "outcome"],
        )
        self.backend_call_duration_s = metrics.histogram(
            "backend_call_duration_seconds", "Duration of backend and registration calls, seconds", ["operation"]
        )
        self.idempotent_replays = metrics.counter(
            "idempotent_replays", "POST /v1/jobs answered with an existing job (same Idempotency-Key and body)"
        )
        self.sse_streams = metrics.gauge("sse_streams", "Open GET /v1/jobs/{id}/events streams")
