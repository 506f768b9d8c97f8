"""Health hysteresis and the circuit breaker as plain state machines (time passed in)."""

from __future__ import annotations

from miles.router.breaker import BreakerState, CircuitBreaker, HealthTracker


def test_new_engine_is_healthy_after_first_success() -> None:
    health = HealthTracker(failure_threshold=3, success_threshold=2)
    assert not health.healthy
    assert health.record(True) is True
    assert health.healthy


def test_health_needs_consecutive_failures_and_successes() -> None:
    health = HealthTracker(failure_threshold=3, success_threshold=2)
    health.force(True)
    assert not health.record(False)
    assert not health.record(False)
    assert not health.record(True)  # resets the failure count
    assert not health.record(False)
    assert not health.record(False)
    assert health.record(False) and not health.healthy
    assert not health.record(True)  # one success is not enough once it was up before
    assert health.record(True) and health.healthy


def test_breaker_opens_after_consecutive_failures_then_half_opens() -> None:
    breaker = CircuitBreaker(failure_threshold=3, success_threshold=2, open_s=10.0)
    for _ in range(2):
        breaker.record_failure(now_s=0.0)
    assert breaker.allows(0.0)
    breaker.record_failure(now_s=1.0)
    assert breaker.state is BreakerState.OPEN
    assert not breaker.allows(10.9)
    assert breaker.allows(11.0)
    assert breaker.state is BreakerState.HALF_OPEN
    breaker.record_success()
    assert breaker.state is BreakerState.HALF_OPEN
    breaker.record_success()
    assert breaker.state is BreakerState.CLOSED


def test_failure_while_half_open_reopens() -> None:
    breaker = CircuitBreaker(failure_threshold=1, success_threshold=1, open_s=5.0)
    breaker.record_failure(now_s=0.0)
    assert breaker.allows(5.0)
    breaker.record_failure(now_s=5.0)
    assert breaker.state is BreakerState.OPEN
    assert not breaker.allows(9.9)


def test_success_resets_the_failure_count() -> None:
    breaker = CircuitBreaker(failure_threshold=2, success_threshold=1, open_s=5.0)
    breaker.record_failure(0.0)
    breaker.record_success()
    breaker.record_failure(0.0)
    assert breaker.state is BreakerState.CLOSED
