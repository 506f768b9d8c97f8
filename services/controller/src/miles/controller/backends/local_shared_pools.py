"""The local backend's shared engine pools: the engines LoRA jobs share, started once and kept running.

A pool declared in the controller's `shared_pools` starts when the first job placed on it starts (nobody pays for a
pool no job uses), as `replicas` `miles-engine` processes of the pool's base model with SGLang's LoRA flags
(`SharedPool.engine_args`), registered at the router under the pool's name. Its state lives in
`<state_dir>/pools/<name>/` like a job's (state.json, logs, pid files), so a restarted controller adopts its
engines; it is supervised like a job's processes (restarts with backoff; see `local_supervise`). Jobs ending do not
stop it: their adapters are unloaded by their trainers' retirement, and the next job on the pool finds it warm.

Limits: a pool's size is its declaration's (no resize API); a pool removed from the settings keeps running until
its engines are stopped by hand (`<state_dir>/pools/<name>/*.pid`); a pool that ran out of restarts starts afresh at
the next job that needs it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from pathlib import Path

from miles.controller.backends.base import PlatformTokens, SharedPool
from miles.controller.backends.local_layout import engine_process
from miles.controller.backends.local_processes import ProcessRecord
from miles.controller.backends.local_state import LocalJob
from miles.controller.backends.local_supervise import ProcessSupervisor

log = logging.getLogger(__name__)


def pool_engine_record(pool_dir: Path, pool: SharedPool, index: int, tokens: PlatformTokens) -> ProcessRecord:
    """Engine `index` of the shared pool: the base model with the pool's LoRA flags, then its extra args."""
    args = [*pool.engine_args(), *pool.extra_args]
    return engine_process(f"engine-{index}", pool.model_path, args, pool_dir, tokens, {"index": index})


class SharedPoolRunner:
    """Starts (or adopts) declared pools on demand and supervises them until the controller closes."""

    def __init__(
        self,
        pools: tuple[SharedPool, ...],
        state_dir: Path,
        supervisor: ProcessSupervisor,
        tokens: PlatformTokens,
        *,
        monitor_interval_s: float,
    ) -> None:
        self.declared = {pool.name: pool for pool in pools}
        self.state_dir = state_dir
        self.supervisor = supervisor
        self.tokens = tokens
        self.monitor_interval_s = monitor_interval_s
        self._groups: dict[str, LocalJob] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self._monitors: dict[str, asyncio.Task[None]] = {}

    def pool_dir(self, name: str) -> Path:
        return self.state_dir / "pools" / name

    async def ensure(self, name: str) -> None:
        """The pool's engines run (adopted when they already do); ValueError for a pool not declared."""
        pool = self.declared.get(name)
        if pool is None:
            raise ValueError(f"no shared engine pool {name!r} is declared (controller setting shared_pools)")
        async with self._locks.setdefault(name, asyncio.Lock()):
            group = self._groups.get(name) or LocalJob.load(name, self.pool_dir(name))
            if group is None or group.failed or group.stopped:
                group = LocalJob(name, self.pool_dir(name))
                group.job_dir.mkdir(parents=True, exist_ok=True)
                records = [pool_engine_record(group.job_dir, pool, i, self.tokens) for i in range(pool.replicas)]
                group.processes = {record.name: record for record in records}
            self._groups[name] = group
            try:
                for record in group.processes.values():
                    if self.supervisor.table.is_running(record):
                        log.info("adopted %s of shared pool %s (pid %d)", record.name, name, record.pid)
                    else:
                        self.supervisor.table.spawn(record, group.job_dir)
            finally:
                group.save()
        running = self._monitors.get(name)
        if running is None or running.done():
            self._monitors[name] = asyncio.create_task(self._monitor(name), name=f"shared-pool-{name}")

    def ready_engines(self, name: str) -> int:
        """Engines of the pool that are ready and running (0 for a pool not started by this controller)."""
        group = self._groups.get(name)
        if group is None:
            return 0
        return sum(1 for r in group.by_role("engine") if r.ready and self.supervisor.table.is_running(r))

    def problem(self, name: str) -> str:
        """The pool's failure or latest recoverable problem ("" when none)."""
        group = self._groups.get(name)
        if group is None:
            return ""
        return f"shared pool {name}: {group.error or group.notice}" if group.error or group.notice else ""

    def engine_urls(self, name: str) -> list[str]:
        group = self._groups.get(name)
        return [record.url for record in group.by_role("engine")] if group is not None else []

    async def stop(self, name: str, grace_s: float) -> None:
        """Stop the pool's engines (operators and tests; jobs never do): out of the router pool, then SIGTERM."""
        monitor = self._monitors.pop(name, None)
        if monitor is not None:
            monitor.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await monitor
        async with self._locks.setdefault(name, asyncio.Lock()):
            group = self._groups.pop(name, None) or LocalJob.load(name, self.pool_dir(name))
            if group is None:
                return
            for engine in group.by_role("engine"):
                await self.supervisor.pool.deregister(name, engine.url)
            await asyncio.to_thread(self.supervisor.table.stop_all, list(group.processes.values()), grace_s)
            group.stopped = True
            group.save()

    async def close(self) -> None:
        """Stop supervising (the engines keep running, like every local process, for the next controller)."""
        monitors = list(self._monitors.values())
        self._monitors.clear()
        for monitor in monitors:
            monitor.cancel()
        for monitor in monitors:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await monitor

    async def _monitor(self, name: str) -> None:
        while True:
            await asyncio.sleep(self.monitor_interval_s)
            group = self._groups.get(name)
            if group is None:
                return
            try:
                async with self._locks[name]:
                    await self.supervisor.supervise(group)
            except Exception:
                log.exception("supervision pass of shared pool %s failed", name)
