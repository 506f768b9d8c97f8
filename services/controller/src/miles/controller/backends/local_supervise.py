"""One supervision pass over a group of local processes (a job's, or a shared engine pool's): restart what exited
with an exponential backoff, notice readiness, keep engines registered in their router pool.

A group is a `LocalJob` whose `job_id` names its router pool (the job id, or the shared pool's name). A process that
exited is started again after `restart_backoff_initial_s` doubling up to `restart_backoff_max_s`; after
`max_restarts` restarts in a row without `restart_reset_s` of uptime the group fails with the process name, its exit
code and the tail of its log. Every `POOL_CHECK_INTERVAL_S` the router's view is compared with the group's engines
(and its inference pools' engines, in their own router pools), and those it forgot (it restarted: its registry is
in memory) are registered again.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import httpx

from miles.controller.backends.local_pool import RouterPool
from miles.controller.backends.local_processes import ProcessRecord, ProcessTable, log_tail
from miles.controller.backends.local_state import LocalJob

log = logging.getLogger(__name__)
POOL_CHECK_INTERVAL_S = 5.0


@dataclass(frozen=True)
class RestartPolicy:
    """When a process that exited is started again, and when its group fails instead."""

    max_restarts: int = 5
    restart_backoff_initial_s: float = 1.0
    restart_backoff_max_s: float = 30.0
    restart_reset_s: float = 60.0
    """Uptime after which a process's restarts-in-a-row count starts again from 0."""


def router_pool_of(group: LocalJob, record: ProcessRecord) -> str:
    """The router pool a process serves in ("" for one that is not an engine): the group's pool for its engines,
    the inference pool's own for an engine of a job's judge or teacher."""
    if record.role == "engine":
        return group.job_id
    return str(record.extra.get("router_pool", ""))


class ProcessSupervisor:
    """Supervision passes over process groups; the caller holds the group's lock."""

    def __init__(self, table: ProcessTable, pool: RouterPool, http: httpx.AsyncClient, policy: RestartPolicy) -> None:
        self.table = table
        self.pool = pool
        self.policy = policy
        self._http = http
        self._last_pool_check: dict[str, float] = {}

    async def supervise(self, group: LocalJob) -> None:
        """One pass: restart what exited (with backoff), notice readiness, keep engines registered."""
        if group.stopped:
            return
        changed = False
        now = time.time()
        for record in group.processes.values():
            code = self.table.exit_code(record)
            if code is None:
                changed |= await self._check_live(group, record, now)
            elif not group.failed:
                changed |= self._handle_exit(group, record, code, now)
        if not group.was_running and all(record.ready for record in group.processes.values()):
            group.was_running = changed = True
        changed |= await self._check_pool(group, now)
        if changed:
            group.save()

    async def _check_live(self, group: LocalJob, record: ProcessRecord, now: float) -> bool:
        changed = False
        if record.restarts and now - record.started_at_s >= self.policy.restart_reset_s:
            record.restarts, changed = 0, True
        if not record.ready:
            record.ready = await self._is_ready(record)
            changed |= record.ready
        if router_pool_of(group, record) and record.ready and not record.registered:
            record.registered = await self.pool.register(router_pool_of(group, record), record.url)
            changed |= record.registered
        return changed

    def _handle_exit(self, group: LocalJob, record: ProcessRecord, code: int, now: float) -> bool:
        if record.next_start_at_s == 0.0:
            record.last_exit_code, record.ready, record.registered = code, False, False
            if record.restarts >= self.policy.max_restarts:
                group.failed = True
                group.error = (
                    f"{record.name} exited with code {code} after {record.restarts} restarts in a row; "
                    f"last lines of {record.log_path}:\n{log_tail(record.log_path)}"
                )
                log.error("%s failed: %s", group.job_id, group.error)
                return True
            delay_s = min(self.policy.restart_backoff_initial_s * 2**record.restarts, self.policy.restart_backoff_max_s)
            record.next_start_at_s = now + delay_s
            group.notice = f"{record.name} exited with code {code}; restart {record.restarts + 1} in {delay_s:.1f}s"
            log.warning("%s: %s", group.job_id, group.notice)
            return True
        if now >= record.next_start_at_s:
            self.table.spawn(record, group.job_dir)
            record.restarts += 1
            record.total_restarts += 1
            return True
        return False

    async def _is_ready(self, record: ProcessRecord) -> bool:
        if not record.ready_url:
            return True
        try:
            response = await self._http.get(record.ready_url)
        except httpx.HTTPError:
            return False
        return response.status_code == 200

    async def _check_pool(self, group: LocalJob, now: float) -> bool:
        """Every few seconds: engines the router forgot (it restarted) are registered again."""
        key = str(group.job_dir)
        routed = [record for record in group.processes.values() if router_pool_of(group, record)]
        if not routed or now - self._last_pool_check.get(key, 0.0) < POOL_CHECK_INTERVAL_S:
            return False
        self._last_pool_check[key] = now
        changed = False
        for pool_name in sorted({router_pool_of(group, record) for record in routed}):
            known = await self.pool.engine_urls(pool_name)
            if known is None:
                continue
            for record in routed:
                if router_pool_of(group, record) == pool_name and record.registered and record.url not in known:
                    record.registered, changed = False, True
        return changed
