"""Prometheus metrics of the sandbox-gateway (names miles_sandbox_<what>_<unit>; labels are bounded sets)."""

from __future__ import annotations

from miles.common.telemetry import Metrics

STARTUP_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class SandboxMetrics:
    """Every metric the gateway core records. Label values: backend name, source warm|cold, limit kind."""

    def __init__(self, metrics: Metrics) -> None:
        self.registry = metrics.registry
        self.live_sandboxes = metrics.gauge(
            "live_sandboxes", "Sandboxes alive now, warm pool not included", ["backend"]
        )
        self.warm_pool_sandboxes = metrics.gauge(
            "warm_pool_sandboxes", "Started sandboxes waiting in the warm pool", ["backend"]
        )
        self.startup_duration_s = metrics.histogram(
            "startup_duration_seconds",
            "Time from Create to a usable sandbox, seconds; source=warm when served from the pool",
            ["backend", "source"],
            buckets=STARTUP_BUCKETS_S,
        )
        self.exec_duration_s = metrics.histogram(
            "exec_duration_seconds", "Wall time of an exec, from request to its result, seconds", ["backend"]
        )
        self.execs = metrics.counter(
            "execs", "Execs finished, by outcome (exit0, nonzero, signal, error)", ["backend", "outcome"]
        )
        self.exec_timeouts = metrics.counter("exec_timeouts", "Execs killed at their timeout_s", ["backend"])
        self.limit_kills = metrics.counter(
            "limit_kills",
            "Execs that ran into a limit (killed, refused or truncated), by limit kind",
            ["backend", "limit"],
        )
        self.sandboxes_created = metrics.counter(
            "sandboxes_created", "Sandboxes handed out by Create, by source (warm, cold)", ["backend", "source"]
        )
        self.sandboxes_destroyed = metrics.counter(
            "sandboxes_destroyed",
            "Sandboxes destroyed, by reason (request, ttl, dead, shutdown)",
            ["backend", "reason"],
        )
        self.create_failures = metrics.counter("create_failures", "Creates the backend failed", ["backend"])
        self.quota_rejections = metrics.counter(
            "quota_rejections", "Creates refused by a quota, by scope (job, gateway)", ["scope"]
        )
