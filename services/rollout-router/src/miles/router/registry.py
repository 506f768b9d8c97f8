"""Every pool of the router, and how engines are built from settings.

Pools are created on first use by a registry source (static settings, the admin API, Kubernetes discovery); a
data-plane request for a pool that does not exist gets 503 naming it. Each pool's policy comes from
`policy` / `pool_policies` in the settings.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

from miles.router.admission import EngineSlots
from miles.router.breaker import CircuitBreaker, HealthTracker
from miles.router.engine import Engine, EngineSource, normalize_engine_url
from miles.router.errors import EngineNotFoundError, NoRoutableEngineError
from miles.router.metrics import RouterMetrics
from miles.router.policies import make_policy
from miles.router.pool import EnginePool, PoolLimits
from miles.router.settings import RouterSettings
from miles.router.snapshots import EngineSnapshot, PoolStatsSnapshot


class PoolRegistry:
    def __init__(
        self, settings: RouterSettings, metrics: RouterMetrics, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.settings = settings
        self.metrics = metrics
        self.clock = clock
        self.pools: dict[str, EnginePool] = {}
        self._limits = PoolLimits(
            queue_timeout_s=settings.queue_timeout_s,
            backpressure_retry_after_s=settings.backpressure_retry_after_s,
            transient_hold_s=settings.transient_hold_s,
        )

    def get_or_create(self, name: str) -> EnginePool:
        pool = self.pools.get(name)
        if pool is None:
            policy = make_policy(self.settings.policy_for(name), self.settings, self.clock)
            pool = EnginePool(name, policy, self.metrics.for_pool(name, policy.name), self._limits, self.clock)
            self.pools[name] = pool
        return pool

    def remove_if_empty(self, name: str) -> bool:
        """Forget a pool that has no engine left (a job's pool when its job ends), unless the settings name it (the
        default pool, a pool with its own policy or static engines): its routing state goes with it, and a later
        request naming it gets the unknown-pool answer. Whether it was removed."""
        pool = self.pools.get(name)
        configured = {self.settings.default_pool, *self.settings.pool_policies, *self.settings.static_engines}
        if pool is None or pool.engines or name in configured:
            return False
        del self.pools[name]
        return True

    def for_request(self, name: str) -> EnginePool:
        """The pool a data-plane request names; 503 when the router knows no such pool."""
        pool = self.pools.get(name)
        if pool is None:
            known = ", ".join(sorted(self.pools)) or "none"
            raise NoRoutableEngineError(
                f"no engine pool named {name!r} (known pools: {known}); set X-Miles-Pool to a registered pool",
                details={"pool": name},
            )
        return pool

    def existing(self, name: str) -> EnginePool:
        """The pool an admin call names; 404 when unknown."""
        pool = self.pools.get(name)
        if pool is None:
            raise EngineNotFoundError(f"no engine pool named {name!r}", field="pool")
        return pool

    def engine(self, pool_name: str, url: str) -> tuple[EnginePool, Engine]:
        pool = self.existing(pool_name)
        engine = pool.engines.get(normalize_engine_url(url))
        if engine is None:
            raise EngineNotFoundError(f"pool {pool_name!r} has no engine {url!r}", field="url")
        return pool, engine

    def new_engine(self, pool_name: str, url: str, source: EngineSource, max_concurrency: int = 0) -> Engine:
        """A fresh Engine record (not yet added to a pool)."""
        settings = self.settings
        return Engine(
            pool=pool_name,
            url=normalize_engine_url(url),
            source=source,
            slots=EngineSlots(max_concurrency or settings.engine_max_concurrency, settings.engine_max_queue),
            health=HealthTracker(settings.health_failure_threshold, settings.health_success_threshold),
            breaker=CircuitBreaker(
                settings.circuit_failure_threshold, settings.circuit_success_threshold, settings.circuit_open_s
            ),
            configured_max_concurrency=max_concurrency,
        )

    def all_engines(self) -> Iterator[tuple[EnginePool, Engine]]:
        for pool in list(self.pools.values()):
            for engine in list(pool.engines.values()):
                yield pool, engine

    def engine_snapshots(self) -> list[EngineSnapshot]:
        return [snapshot for pool in list(self.pools.values()) for snapshot in pool.snapshots()]

    def pool_stats(self) -> list[PoolStatsSnapshot]:
        return [pool.stats() for pool in list(self.pools.values())]
