"""Background health checks, generation checks and weight-version polling of every engine, plus the first probe
at registration.

One loop wakes every `tick_s` and starts, for each engine that is due, a health probe (every
`health_check_interval_s`), a generation check and a version read (every `version_poll_interval_s`), each in its
own task so that a slow engine delays nobody; an engine never has two probes of a kind running. The data plane
feeds it too: connection errors count as failed probes (see forwarder.py), and versions seen in responses move an
engine's version forward.

The generation check (`serving_check_path`, SGLang /health_generate) finds engines that answer /health but hold
every request: SGLang paused by /pause_generation, e.g. left paused by a weight update that failed while this
router was down. Such an engine is *paused* (engine.py): it gets no requests, and is checked every
`health_check_interval_s` until it generates again. A new engine is checked before it takes its first request, as
is an unhealthy one about to become healthy, and a paused one at undrain (admin.py); a serving engine every
`serving_check_interval_s`, paused only after `health_failure_threshold` consecutive failures. Draining engines
are not checked: they take no requests, and their undrain checks them.

Limits: the check costs the engine one generated token (on SGLang, none while it is busy: any output counts). On
SGLang a check of a paused engine stays inside the engine for up to SGLANG_HEALTH_CHECK_TIMEOUT (20 s) after this
router gave up on it and logs a failed health check there. An engine too overloaded to answer within
`health_check_timeout_s` looks paused (briefly: the next passing check ends it).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import Callable, Coroutine
from typing import Any

from miles.router.engine import Engine
from miles.router.pool import EnginePool
from miles.router.probes import EngineProber
from miles.router.registry import PoolRegistry
from miles.router.settings import RouterSettings

log = logging.getLogger(__name__)


class EngineMonitor:
    def __init__(
        self,
        registry: PoolRegistry,
        prober: EngineProber,
        settings: RouterSettings,
        clock: Callable[[], float] = time.monotonic,
        tick_s: float = 0.25,
    ) -> None:
        self.registry = registry
        self.prober = prober
        self.settings = settings
        self.clock = clock
        self.tick_s = min(
            tick_s,
            settings.health_check_interval_s,
            settings.version_poll_interval_s,
            settings.serving_check_interval_s,
        )
        self._running: dict[tuple[int, str], asyncio.Task[None]] = {}
        self._loop_task: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self._loop_task is None:
            self._loop_task = asyncio.create_task(self._loop(), name="router-engine-monitor")

    async def stop(self) -> None:
        tasks = [t for t in (self._loop_task, *self._running.values()) if t is not None]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._loop_task = None
        self._running.clear()

    async def probe_new_engine(self, pool: EnginePool, engine: Engine) -> None:
        """First look at an engine: health and the generation check decide its state at once (no hysteresis),
        then capacity and version."""
        healthy = await self.prober.health(engine.url)
        if healthy:  # before it can take a request: a paused engine would hold it
            await self.check_serving(pool, engine, failures_to_pause=1)
        engine.health.force(healthy)
        engine.last_health_check_s = self.clock()
        if not healthy:
            log.warning("engine not healthy at registration", extra={"pool": pool.name, "engine": engine.url})
            return
        capacity = await self.prober.capacity(engine.url)
        engine.kv_capacity_tokens = capacity.max_total_num_tokens
        if not engine.configured_max_concurrency and capacity.max_running_requests:
            engine.slots.resize(capacity.max_running_requests)
        await self.refresh_version(pool, engine)

    async def refresh_version(self, pool: EnginePool, engine: Engine) -> None:
        answered, version = await self.prober.weight_version(engine.url)
        engine.last_version_poll_s = self.clock()
        if answered:
            pool.record_version(engine, version, authoritative=True)

    async def check_serving(self, pool: EnginePool, engine: Engine, *, failures_to_pause: int) -> None:
        """One generation check (see the module docstring); `failures_to_pause` consecutive failures pause a
        serving engine."""
        ok = await self.prober.serving(engine.url)
        engine.last_serving_check_s = self.clock()
        if pool.record_serving(engine, ok, failures_to_pause=failures_to_pause):
            log.warning(
                "engine generation paused" if engine.paused else "engine generation serving again",
                extra={"pool": pool.name, "engine": engine.url, "paused": engine.paused},
            )

    async def check_health(self, pool: EnginePool, engine: Engine) -> None:
        ok = await self.prober.health(engine.url)
        engine.last_health_check_s = self.clock()
        if ok and not engine.health.healthy:  # it may become healthy now: find out first whether it is paused
            await self.check_serving(pool, engine, failures_to_pause=1)
            await self.refresh_version(pool, engine)  # and which weights it holds (a restart loads the initial ones)
        was_healthy = engine.health.healthy
        pool.record_health(engine, ok)
        if was_healthy != engine.health.healthy:
            log.warning(
                "engine health changed",
                extra={"pool": pool.name, "engine": engine.url, "healthy": engine.health.healthy},
            )

    async def _loop(self) -> None:
        while True:
            now_s = self.clock()
            for pool, engine in self.registry.all_engines():
                if now_s - engine.last_health_check_s >= self.settings.health_check_interval_s:
                    self._spawn(engine, "health", functools.partial(self.check_health, pool, engine))
                if now_s - engine.last_version_poll_s >= self.settings.version_poll_interval_s:
                    self._spawn(engine, "version", functools.partial(self.refresh_version, pool, engine))
                if self._serving_check_due(engine, now_s):
                    threshold = self.settings.health_failure_threshold
                    check = functools.partial(self.check_serving, pool, engine, failures_to_pause=threshold)
                    self._spawn(engine, "serving", check)
            await asyncio.sleep(self.tick_s)

    def _serving_check_due(self, engine: Engine, now_s: float) -> bool:
        if not self.prober.serving_path or not engine.serving_check_supported:
            return False
        if engine.draining or not engine.health.healthy:
            return False
        suspect = engine.paused or engine.serving_check_failures > 0
        interval_s = self.settings.health_check_interval_s if suspect else self.settings.serving_check_interval_s
        return now_s - engine.last_serving_check_s >= interval_s

    def _spawn(self, engine: Engine, kind: str, probe: Callable[[], Coroutine[Any, Any, None]]) -> None:
        key = (id(engine), kind)
        running = self._running.get(key)
        if running is not None and not running.done():
            return
        task = asyncio.create_task(probe())
        self._running[key] = task
        task.add_done_callback(functools.partial(self._finished, key))

    def _finished(self, key: tuple[int, str], task: asyncio.Task[None]) -> None:
        if self._running.get(key) is task:
            del self._running[key]
        if not task.cancelled() and task.exception() is not None:
            log.error("engine probe failed", exc_info=task.exception())
