"""The admin operations behind RouterAdminService (gRPC) and its HTTP mirror under /admin/v1/.

Register (idempotent by pool + url; probes the engine once so its state — paused included —, capacity and version
are known when the call returns), deregister (a pool whose last engine goes is forgotten, unless the settings name
it: a job's pool ends with the job), drain (optionally waiting until nothing is in flight or queued, at
most the given timeout or `drain_timeout_s` — weight-sync drains an engine, updates it, then undrains it),
undrain (re-reads the weight version first, so requests demanding the new version reach the engine at once, and
re-checks an engine found paused), list, stats. Both transports call these and only translate types.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

from miles.router.clients import EngineClients
from miles.router.engine import EngineSource, normalize_engine_url
from miles.router.errors import InvalidRoutingInputError
from miles.router.monitor import EngineMonitor
from miles.router.pool import EnginePool
from miles.router.registry import PoolRegistry
from miles.router.settings import RouterSettings
from miles.router.snapshots import EngineSnapshot, PoolStatsSnapshot

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DrainResult:
    engine: EngineSnapshot
    drained: bool


class RouterAdmin:
    def __init__(
        self, registry: PoolRegistry, monitor: EngineMonitor, settings: RouterSettings, clients: EngineClients
    ) -> None:
        self.registry = registry
        self.monitor = monitor
        self.clients = clients
        self.settings = settings

    async def register_engine(
        self, pool_name: str, url: str, max_concurrency: int = 0, source: EngineSource = EngineSource.ADMIN
    ) -> EngineSnapshot:
        """Add an engine (or update its limit when already registered) and probe it once."""
        pool_name = _pool_name(pool_name, self.settings)
        normalized = normalize_engine_url(url)
        if max_concurrency < 0:
            raise InvalidRoutingInputError("max_concurrency must be >= 0", field="max_concurrency")
        pool = self.registry.get_or_create(pool_name)
        existing = pool.engines.get(normalized)
        if existing is not None:
            if max_concurrency:
                existing.configured_max_concurrency = max_concurrency
                existing.slots.resize(max_concurrency)
            return pool.snapshot(existing)
        engine = self.registry.new_engine(pool_name, normalized, source, max_concurrency)
        pool.add(engine)
        await self.monitor.probe_new_engine(pool, engine)
        log.info("engine registered", extra={"pool": pool_name, "engine": normalized, "source": source.value})
        return pool.snapshot(engine)

    def deregister_engine(self, pool_name: str, url: str) -> bool:
        pool, engine = self.registry.engine(_pool_name(pool_name, self.settings), url)
        removed = pool.remove(engine.url) is not None
        if not any(engine.url in other.engines for other in self.registry.pools.values()):
            self.monitor.prober.forget(engine.url)
            self.clients.retire(engine)
        log.info("engine deregistered", extra={"pool": pool.name, "engine": engine.url})
        if self.registry.remove_if_empty(pool.name):
            log.info("empty pool removed", extra={"pool": pool.name})
        return removed

    async def drain_engine(self, pool_name: str, url: str, wait: bool, timeout_s: float) -> DrainResult:
        pool, engine = self.registry.engine(_pool_name(pool_name, self.settings), url)
        pool.drain(engine)
        drained = engine.slots.is_idle()
        if wait and not drained:
            drained = await engine.slots.wait_idle(timeout_s if timeout_s > 0 else self.settings.drain_timeout_s)
        log.info("engine draining", extra={"pool": pool.name, "engine": engine.url, "drained": drained})
        return DrainResult(pool.snapshot(engine), drained)

    async def undrain_engine(self, pool_name: str, url: str) -> EngineSnapshot:
        pool, engine = self.registry.engine(_pool_name(pool_name, self.settings), url)
        await self.monitor.refresh_version(pool, engine)
        # An update may have failed health probes while drained (SGLang's /health blocks behind weight loads);
        # the caller says it is ready, so one good probe now is enough to take requests again.
        if not engine.health.healthy and await self.monitor.prober.health(engine.url):
            engine.health.force(True)
            engine.breaker.reset()
        # Found paused (e.g. at registration, while an update that began before this router started held it): the
        # caller has resumed it, so one passing generation check now lets it take requests again; if it fails, the
        # monitor keeps checking it.
        if engine.paused:
            await self.monitor.check_serving(pool, engine, failures_to_pause=1)
        engine.draining = False
        log.info("engine undrained", extra={"pool": pool.name, "engine": engine.url})
        return pool.snapshot(engine)

    async def sync_discovered(self, desired: dict[str, set[str]]) -> None:
        """Make the Kubernetes-sourced engines of every pool exactly `desired` (other sources are left alone)."""
        for pool_name, pool in list(self.registry.pools.items()):
            wanted = desired.get(pool_name, set())
            for engine in list(pool.engines.values()):
                if engine.source is EngineSource.KUBERNETES and engine.url not in wanted:
                    self.deregister_engine(pool_name, engine.url)
        additions = [
            self.register_engine(pool_name, url, source=EngineSource.KUBERNETES)
            for pool_name, urls in desired.items()
            for url in sorted(urls)
            if pool_name not in self.registry.pools
            or normalize_engine_url(url) not in self.registry.pools[pool_name].engines
        ]
        await asyncio.gather(*additions)

    def list_engines(self, pool_name: str = "") -> list[EngineSnapshot]:
        if not pool_name:
            return self.registry.engine_snapshots()
        pool = self.registry.pools.get(pool_name)
        return pool.snapshots() if pool is not None else []

    def served_versions(self, pool_name: str = "") -> list[int | None]:
        """The weight version of each engine of the pool that takes requests now (None: not known yet); [] for a
        pool with none (or no such pool: a job's pool appears with its first engine)."""
        pool = self.registry.pools.get(_pool_name(pool_name, self.settings))
        if pool is None:
            return []
        now_s = pool.clock()
        return [engine.weight_version for engine in pool.engines.values() if engine.is_available(now_s)]

    def stats(self, pool_name: str = "") -> PoolStatsSnapshot:
        pool: EnginePool = self.registry.existing(_pool_name(pool_name, self.settings))
        return pool.stats()


def _pool_name(pool_name: str, settings: RouterSettings) -> str:
    return pool_name.strip() or settings.default_pool
