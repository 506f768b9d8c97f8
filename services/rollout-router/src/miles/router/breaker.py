"""Health tracking and the circuit breaker of one engine: the two reasons an engine gets no requests.

`HealthTracker` turns probe results (and data-plane connection errors, treated as failed probes) into a healthy
flag with hysteresis: unhealthy after `failure_threshold` consecutive failures, healthy again after
`success_threshold` consecutive successes. A new engine starts unhealthy and its first success makes it healthy
at once (an engine that was never up has nothing to prove). `CircuitBreaker` watches request outcomes:
`failure_threshold` consecutive failed requests open it for `open_s`; then it is half-open and
`success_threshold` successful trial requests close it, while one failure opens it again. Time comes from the
caller (`now_s`), so both are plain state machines, tested without sleeping.

Limits: counts are consecutive (a success resets the failure count), not windowed like the SGLang router's.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


@dataclass
class HealthTracker:
    failure_threshold: int
    success_threshold: int
    healthy: bool = False
    ever_healthy: bool = False
    consecutive_failures: int = 0
    consecutive_successes: int = 0

    def record(self, ok: bool) -> bool:
        """Record one probe outcome; returns True when the healthy flag changed."""
        was_healthy = self.healthy
        if ok:
            self.consecutive_successes += 1
            self.consecutive_failures = 0
            if not self.healthy and (not self.ever_healthy or self.consecutive_successes >= self.success_threshold):
                self.healthy = self.ever_healthy = True
        else:
            self.consecutive_failures += 1
            self.consecutive_successes = 0
            if self.healthy and self.consecutive_failures >= self.failure_threshold:
                self.healthy = False
        return was_healthy != self.healthy

    def force(self, healthy: bool) -> None:
        """Set the state outright (the first probe at registration decides without hysteresis)."""
        self.healthy = healthy
        self.ever_healthy = self.ever_healthy or healthy
        self.consecutive_failures = 0
        self.consecutive_successes = 0


class BreakerState(enum.Enum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


@dataclass
class CircuitBreaker:
    failure_threshold: int
    success_threshold: int
    open_s: float
    state: BreakerState = BreakerState.CLOSED
    consecutive_failures: int = 0
    consecutive_successes: int = 0
    opened_at_s: float = 0.0

    def allows(self, now_s: float) -> bool:
        """Whether a request may be sent now (moves OPEN to HALF_OPEN once open_s has passed)."""
        if self.state is BreakerState.OPEN and now_s - self.opened_at_s >= self.open_s:
            self.state = BreakerState.HALF_OPEN
            self.consecutive_successes = 0
        return self.state is not BreakerState.OPEN

    def record_success(self) -> None:
        self.consecutive_failures = 0
        if self.state is BreakerState.HALF_OPEN:
            self.consecutive_successes += 1
            if self.consecutive_successes >= self.success_threshold:
                self.state = BreakerState.CLOSED

    def record_failure(self, now_s: float) -> None:
        self.consecutive_failures += 1
        self.consecutive_successes = 0
        if self.state is BreakerState.HALF_OPEN or self.consecutive_failures >= self.failure_threshold:
            self.state = BreakerState.OPEN
            self.opened_at_s = now_s

    def reset(self) -> None:
        self.state = BreakerState.CLOSED
        self.consecutive_failures = 0
        self.consecutive_successes = 0
