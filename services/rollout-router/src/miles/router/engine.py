"""One engine as the router sees it: address, source, admission slots, health, circuit breaker, weight version.

An `Engine` is *available* when it is healthy, not paused, not draining and its breaker lets requests through;
only available engines are offered to a routing policy. *Paused* means its generation check failed (monitor.py):
SGLang answers /health while /pause_generation holds every new request, so health alone would route requests into
a pause that may last until a weight update resumes the engine. A paused engine is listed as unhealthy (the
admin contract has no paused state). Its `weight_version` is SGLang's `weight_version` string read by
`miles.common.contracts.weight_version` ("default" = 0, the initial weights); a label that is no version (None)
is unknown and never satisfies a `min_weight_version`.

*Joining*: an engine added to a pool whose engines already serve a version past the initial weights (a resize, a
replaced pod, a restarted engine at a new address), or one that comes back healthy behind them (restarted at the
same address), must not serve the job's requests on older weights, so it takes none until it reports that
version (`admit_at_version`; weight-sync catches it up: its reconcile loop, or the next publish for transports
that find engines in the pool). Once admitted it is an engine like the others: a later rolling update that leaves
it behind for a while does not take it out again. Listed as unhealthy with `admit_at_version` set (the admin
contract's `admit_at_weight_version`).
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import httpx

from miles.router.admission import EngineSlots
from miles.router.breaker import BreakerState, CircuitBreaker, HealthTracker
from miles.router.errors import InvalidRoutingInputError


class EngineSource(enum.Enum):
    STATIC = "static"
    ADMIN = "admin"
    KUBERNETES = "kubernetes"


class EngineState(enum.Enum):
    HEALTHY = "healthy"
    UNHEALTHY = "unhealthy"
    DRAINING = "draining"
    DRAINED = "drained"


def normalize_engine_url(url: str) -> str:
    """The canonical form of an engine base URL (scheme + host[:port] + path without trailing slash); raises
    InvalidRoutingInputError for anything else, including what the HTTP client could not send a request to (a host
    that is no valid name, a port that is no number, control characters, lone surrogates)."""
    stripped = url.strip().rstrip("/")
    try:
        parts = urlsplit(stripped)
        httpx.URL(stripped)
    except (ValueError, httpx.InvalidURL) as exc:  # ValueError: e.g. an unclosed [IPv6], a lone surrogate
        raise InvalidRoutingInputError(f"engine url {url!r} is not a valid URL: {exc}", field="url") from None
    if parts.scheme not in ("http", "https") or not parts.netloc or parts.query or parts.fragment:
        raise InvalidRoutingInputError(f"engine url {url!r} must be http(s)://host[:port][/path]", field="url")
    return stripped


@dataclass(eq=False)
class Engine:
    """Mutable state of one registered engine (owned by its pool; one event loop)."""

    pool: str
    url: str
    source: EngineSource
    slots: EngineSlots
    health: HealthTracker
    breaker: CircuitBreaker
    configured_max_concurrency: int = 0
    """Explicit limit from RegisterEngine (0 = none: engine-reported or router default)."""
    weight_version: int | None = None
    draining: bool = False
    paused: bool = False
    """The generation check failed (SGLang paused, or loading weights): no requests until a check passes."""
    admit_at_version: int | None = None
    """Joining (see the module docstring): no requests until `weight_version` reaches this; None once admitted."""
    serving_check_failures: int = 0
    """Consecutive failed generation checks while not paused (hysteresis before pausing a serving engine)."""
    serving_check_supported: bool = True
    """False once the engine answered the generation check with 404/405 (no such route: never checked again)."""
    kv_capacity_tokens: int | None = None
    removed: bool = False
    last_health_check_s: float = field(default=-1e18)
    last_version_poll_s: float = field(default=-1e18)
    last_serving_check_s: float = field(default=-1e18)

    def is_available(self, now_s: float | None = None) -> bool:
        """Admitted, healthy, not paused, not draining, not removed, and the breaker lets requests through."""
        if self.removed or self.draining or self.paused or self.admit_at_version is not None or not self.health.healthy:
            return False
        return self.breaker.allows(time.monotonic() if now_s is None else now_s)

    def serves_version(self, min_weight_version: int | None) -> bool:
        if min_weight_version is None:
            return True
        return self.weight_version is not None and self.weight_version >= min_weight_version

    def state(self, now_s: float | None = None) -> EngineState:
        if self.draining:
            return EngineState.DRAINED if self.slots.is_idle() else EngineState.DRAINING
        if not self.health.healthy or self.paused or self.admit_at_version is not None:
            return EngineState.UNHEALTHY
        if not self.breaker.allows(time.monotonic() if now_s is None else now_s):
            return EngineState.UNHEALTHY
        return EngineState.HEALTHY

    @property
    def circuit_open(self) -> bool:
        return self.breaker.state is BreakerState.OPEN

    def observe_version(self, version: int | None, *, authoritative: bool) -> bool:
        """Record a weight version; returns True when it changed.

        Polls are authoritative (an engine restarted on older weights goes back); versions seen in responses only
        move forward, so a late response of an older version cannot undo a newer poll.
        """
        if version is None:
            return False
        if not authoritative and self.weight_version is not None and version <= self.weight_version:
            return False
        changed = version != self.weight_version
        self.weight_version = version
        if self.admit_at_version is not None and version >= self.admit_at_version:
            self.admit_at_version = None
        return changed
