"""An engine pool: the engines of one job, its routing policy state and its counters.

`select` narrows the pool to candidates — available (healthy, not paused, not draining, breaker closed), at the
request's `min_weight_version`, not already failed for this request, with room in their queue — and asks the
policy. Each narrowing step that empties the set has its own answer: no engine available → 503, none at the
version → 409 (retryable), every queue full → 429 + Retry-After. `acquire` first waits (up to
`transient_hold_s`) while the only engines out of rotation are drained for an update or joining, then waits for a
slot in the chosen engine's fair queue and re-selects if the engine stopped taking requests meanwhile. A request
of this pool never sees an engine of another pool: each pool has its own engines, policy and tree.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass

from miles.router.admission import QueueRejectedError
from miles.router.engine import Engine, EngineState
from miles.router.errors import BackpressureError, NoRoutableEngineError, WeightVersionTooOldError
from miles.router.metrics import PoolCounters
from miles.router.policies import RoutingPolicy, Selection
from miles.router.routing_input import RoutingInput
from miles.router.snapshots import EngineSnapshot, PoolStatsSnapshot

TRANSIENT_POLL_S = 0.05


@dataclass(frozen=True)
class PoolLimits:
    queue_timeout_s: float
    backpressure_retry_after_s: float
    transient_hold_s: float = 0.0
    """Longest an acquire waits while the pool's only candidates are drained or joining (see `_transient`)."""


@dataclass(eq=False)
class Lease:
    """A slot held on one engine for one attempt; release exactly once."""

    engine: Engine
    selection: Selection
    num_tokens: int
    queue_wait_s: float
    released: bool = False

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.engine.slots.release(self.num_tokens)


class EnginePool:
    def __init__(
        self,
        name: str,
        policy: RoutingPolicy,
        counters: PoolCounters,
        limits: PoolLimits,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.name = name
        self.policy = policy
        self.counters = counters
        self.limits = limits
        self.clock = clock
        self.engines: dict[str, Engine] = {}

    # --- membership and engine state ---------------------------------------------------------------------------
    def add(self, engine: Engine) -> None:
        """Add an engine; one joining a pool that has moved past the initial weights waits for their version."""
        self._hold_until_current(engine)
        self.engines[engine.url] = engine
        self.policy.on_engine_added(engine)

    def newest_admitted_version(self, excluding: str = "") -> int | None:
        """The newest weight version an admitted engine of this pool (other than `excluding`) reports (None: no
        engine knows one)."""
        versions = [
            engine.weight_version
            for engine in self.engines.values()
            if engine.weight_version is not None
            and engine.admit_at_version is None
            and not engine.removed
            and engine.url != excluding
        ]
        return max(versions, default=None)

    def _hold_until_current(self, engine: Engine) -> None:
        """Joining (engine.py): an engine that (re)appears behind a pool past the initial weights waits for their
        newest version; its own version, when known, may already be there."""
        newest = self.newest_admitted_version(excluding=engine.url)
        if newest is None or newest <= 0:
            return
        if engine.weight_version is None or engine.weight_version < newest:
            engine.admit_at_version = newest

    def remove(self, url: str) -> Engine | None:
        engine = self.engines.pop(url, None)
        if engine is not None:
            engine.removed = True
            engine.slots.reject_waiters()
            self.policy.on_engine_removed(url)
            self.counters.metrics.forget_engine(self.name, url)
        return engine

    def record_health(self, engine: Engine, ok: bool) -> None:
        """One health observation; an engine that comes back has probably restarted, so its cache is forgotten,
        and, when its version (read just before: monitor.py) is behind the pool's, it joins again."""
        if engine.health.record(ok):
            if engine.health.healthy:
                engine.breaker.reset()
                self.policy.on_engine_reset(engine.url)
                self._hold_until_current(engine)
            else:
                engine.slots.reject_waiters()

    def record_serving(self, engine: Engine, ok: bool | None, *, failures_to_pause: int) -> bool:
        """One generation check: `ok` None = the engine has no such route (never paused by it). A paused engine
        serves again after one success; a serving one is paused after `failures_to_pause` consecutive failures
        (its queued requests then go elsewhere). Returns True when `paused` changed."""
        if ok is None:
            engine.serving_check_supported = False
            ok = True
        was_paused = engine.paused
        if ok:
            engine.serving_check_failures = 0
            engine.paused = False
        else:
            engine.serving_check_failures += 1
            if engine.serving_check_failures >= failures_to_pause:
                engine.paused = True
                engine.slots.reject_waiters()
        return was_paused != engine.paused

    def record_version(self, engine: Engine, version: int | None, *, authoritative: bool) -> None:
        """A weight version read from the engine; new weights mean an emptied KV cache."""
        previous = engine.weight_version
        if engine.observe_version(version, authoritative=authoritative) and previous is not None:
            self.policy.on_engine_reset(engine.url)

    def drain(self, engine: Engine) -> None:
        engine.draining = True
        engine.slots.reject_waiters()

    # --- routing ---------------------------------------------------------------------------------------------------
    def select(self, request: RoutingInput, excluded: Collection[str] = ()) -> Selection:
        """The engine for one attempt (see module docstring for the error each empty step gives)."""
        now_s = self.clock()
        engines = list(self.engines.values())
        if not engines:
            raise NoRoutableEngineError(f"pool {self.name!r} has no engines registered", details={"pool": self.name})
        available = [engine for engine in engines if engine.is_available(now_s)]
        if not available:
            raise NoRoutableEngineError(
                f"pool {self.name!r} has no available engine ({self._state_summary(now_s)})",
                details={"pool": self.name},
            )
        at_version = [engine for engine in available if engine.serves_version(request.min_weight_version)]
        if not at_version:
            newest = max((e.weight_version for e in available if e.weight_version is not None), default=None)
            raise WeightVersionTooOldError(
                f"no available engine of pool {self.name!r} serves weight version >= {request.min_weight_version} "
                f"yet (newest: {newest if newest is not None else 'unknown'}); retry later",
                field="min_weight_version",
                retry_after_s=1.0,
                details={"pool": self.name, "min_weight_version": request.min_weight_version, "newest": newest},
            )
        untried = [engine for engine in at_version if engine.url not in excluded] or at_version
        with_room = [engine for engine in untried if engine.slots.can_enqueue()]
        if not with_room:
            raise BackpressureError(
                f"every engine queue of pool {self.name!r} is full",
                retry_after_s=self.limits.backpressure_retry_after_s,
                details={"pool": self.name},
            )
        return self.policy.select(request, with_room)

    def _transient(self) -> bool:
        """Some engine is out of rotation only for a while: drained (weight-sync drains an engine for each update
        and undrains it after; its health probes may fail while it loads) or joining and healthy (admitted once it
        reaches the pool's version). Paused, unhealthy or circuit-open engines give no such promise."""
        return any(
            not e.removed and not e.paused and (e.draining or (e.admit_at_version is not None and e.health.healthy))
            for e in self.engines.values()
        )

    async def _select_or_hold(self, request: RoutingInput, excluded: Collection[str]) -> Selection:
        """`select`, but while no engine is available only because of a drain or a join, wait for one (polling
        every TRANSIENT_POLL_S, at most limits.transient_hold_s) instead of answering 503: a lone engine drained
        for a weight update would otherwise turn every request of the update's seconds into a retry."""
        deadline_s = time.monotonic() + self.limits.transient_hold_s  # real waiting, whatever clock the pool has
        while True:
            try:
                return self.select(request, excluded)
            except NoRoutableEngineError:
                if time.monotonic() >= deadline_s or not self._transient():
                    raise
            await asyncio.sleep(TRANSIENT_POLL_S)

    async def acquire(self, request: RoutingInput, excluded: Collection[str] = ()) -> Lease:
        """Select an engine and take a slot on it (waiting in its FIFO queue)."""
        tried = set(excluded)
        for _ in range(len(self.engines) + 1):
            selection = await self._select_or_hold(request, tried)
            engine = selection.engine
            try:
                wait_s = await engine.slots.acquire(request.num_tokens, self.limits.queue_timeout_s)
            except QueueRejectedError:
                tried.add(engine.url)
                continue
            except BackpressureError as exc:
                raise BackpressureError(
                    f"pool {self.name!r}: {exc.message}",
                    retry_after_s=self.limits.backpressure_retry_after_s,
                    details={"pool": self.name},
                ) from None
            lease = Lease(engine, selection, request.num_tokens, wait_s)
            if engine.is_available(self.clock()) and engine.serves_version(request.min_weight_version):
                return lease
            lease.release()
            tried.add(engine.url)
        raise NoRoutableEngineError(
            f"pool {self.name!r}: engines kept becoming unavailable", details={"pool": self.name}
        )

    # --- views -----------------------------------------------------------------------------------------------------
    def snapshot(self, engine: Engine) -> EngineSnapshot:
        return EngineSnapshot(
            pool=self.name,
            url=engine.url,
            state=engine.state(self.clock()),
            source=engine.source,
            weight_version=engine.weight_version,
            in_flight=engine.slots.num_in_flight,
            queued=engine.slots.num_queued,
            queued_tokens=engine.slots.num_queued_tokens,
            max_concurrency=engine.slots.max_concurrency,
            num_sticky_keys=self.policy.num_sticky_keys(engine.url),
            circuit_open=engine.circuit_open,
            kv_capacity_tokens=engine.kv_capacity_tokens,
            cache_tree_tokens=self.policy.cache_tree_units(engine.url),
            paused=engine.paused,
            admit_at_version=engine.admit_at_version,
        )

    def snapshots(self) -> list[EngineSnapshot]:
        return [self.snapshot(engine) for engine in self.engines.values()]

    def stats(self) -> PoolStatsSnapshot:
        counters = self.counters
        now_s = self.clock()
        return PoolStatsSnapshot(
            pool=self.name,
            policy=self.policy.name,
            requests_total=counters.requests_total,
            retries_total=counters.retries_total,
            failures_total=counters.failures_total,
            sticky_hits_total=counters.sticky_hits_total,
            sticky_misses_total=counters.sticky_misses_total,
            sticky_new_keys_total=counters.sticky_new_keys_total,
            backpressure_total=counters.backpressure_total,
            version_conflicts_total=counters.version_conflicts_total,
            prompt_tokens_total=counters.prompt_tokens_total,
            cached_tokens_total=counters.cached_tokens_total,
            num_engines=len(self.engines),
            num_healthy_engines=sum(1 for e in self.engines.values() if e.state(now_s) is EngineState.HEALTHY),
        )

    def _state_summary(self, now_s: float) -> str:
        counts: dict[str, int] = {}
        for engine in self.engines.values():
            state = engine.state(now_s).value
            if state == "unhealthy" and engine.health.healthy:
                state = "paused" if engine.paused else "circuit open"
                if engine.admit_at_version is not None and not engine.paused:
                    state = f"joining (waiting for version {engine.admit_at_version})"
            counts[state] = counts.get(state, 0) + 1
        return ", ".join(f"{num} {state}" for state, num in sorted(counts.items()))
