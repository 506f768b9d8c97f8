"""The assembled router core: registry, forwarder, monitor, admin operations and optional Kubernetes discovery.

`RouterService.build(settings, metrics)` wires the parts (no I/O); `start()` registers the static engines,
starts health/version monitoring and discovery; `stop()` undoes that. The transports (http_api.py, grpc_api.py)
and main.py only talk to this object, so tests build the same thing in-process; both guard the admin API with
`admin_auth` (the settings' admin_token; no token = open, loopback development mode).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass

from miles.common.auth import BearerAuth
from miles.common.telemetry import Metrics
from miles.router.admin import RouterAdmin
from miles.router.clients import EngineClients
from miles.router.engine import Engine, EngineSource
from miles.router.forwarder import Forwarder
from miles.router.k8s_discovery import EndpointSliceDiscovery
from miles.router.metrics import EngineCollector, RouterMetrics
from miles.router.monitor import EngineMonitor
from miles.router.pool import EnginePool
from miles.router.probes import EngineProber
from miles.router.registry import PoolRegistry
from miles.router.settings import RouterSettings


@dataclass
class RouterService:
    settings: RouterSettings
    registry: PoolRegistry
    clients: EngineClients
    forwarder: Forwarder
    monitor: EngineMonitor
    admin: RouterAdmin
    discovery: EndpointSliceDiscovery | None
    admin_auth: BearerAuth

    @classmethod
    def build(
        cls, settings: RouterSettings, metrics: Metrics, clock: Callable[[], float] = time.monotonic
    ) -> RouterService:
        router_metrics = RouterMetrics(metrics)
        registry = PoolRegistry(settings, router_metrics, clock)
        metrics.registry.register(EngineCollector(metrics, registry.engine_snapshots, registry.pool_stats))
        clients = EngineClients(settings)
        prober = EngineProber(
            clients, settings.health_check_path, settings.health_check_timeout_s, settings.serving_check_path
        )
        monitor = EngineMonitor(registry, prober, settings, clock)
        admin = RouterAdmin(registry, monitor, settings, clients)

        def on_version_stale(pool: EnginePool, engine: Engine) -> None:
            asyncio.get_running_loop().create_task(monitor.refresh_version(pool, engine))

        forwarder = Forwarder(registry, clients, settings, on_version_stale, clock)
        discovery = EndpointSliceDiscovery(settings, admin.sync_discovered) if settings.k8s_discovery else None
        admin_auth = BearerAuth([settings.admin_token.get_secret_value()], what="the router admin API")
        return cls(settings, registry, clients, forwarder, monitor, admin, discovery, admin_auth)

    async def start(self) -> None:
        """Register the static engines (probing each), then start monitoring and discovery."""
        for pool_name in {self.settings.default_pool, *self.settings.startup_engines()}:
            self.registry.get_or_create(pool_name)
        await asyncio.gather(
            *(
                self.admin.register_engine(pool_name, url, source=EngineSource.STATIC)
                for pool_name, urls in self.settings.startup_engines().items()
                for url in urls
            )
        )
        self.monitor.start()
        if self.discovery is not None:
            self.discovery.start()

    async def stop(self) -> None:
        if self.discovery is not None:
            self.discovery.stop()
        await self.monitor.stop()
        await self.clients.aclose()

    async def check_ready(self) -> None:
        """Readiness: Kubernetes discovery (when on) has applied its first listing."""
        if self.discovery is not None and not self.discovery.synced.is_set():
            raise RuntimeError("Kubernetes discovery has not listed the engine EndpointSlices yet")
