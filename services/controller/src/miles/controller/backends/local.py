"""The local backend: runs each job's per-job processes on this machine and keeps them running.

Per job (`<state_dir>/jobs/<job_id>/`: state.json, config files, logs, pid files): N `miles-engine` processes,
their weight-sync origin (the trainer publishes each version to it; stream transport), M `miles-rollout-worker`s
and the `miles-trainer` (see `local_layout`). Engines join the router pool named after the job id once ready.
A LoRA job on a shared engine pool (`resources.engines.shared_pool`) has neither engines nor origin: the pool's
engines (`local_shared_pools`, started with the first job on it and outliving every job) serve its adapters.

Supervision (`local_supervise`): a monitor task per job (and every `observe`) checks each process; one that exited
is started again after an exponential backoff (`restart_backoff_initial_s` doubling up to `restart_backoff_max_s`);
after `max_restarts` restarts in a row without `restart_reset_s` of uptime the job fails with the process name, its
exit code and the tail of its log.

Processes run in their own sessions, so they outlive the controller; a new controller's `start` adopts the
processes recorded in state.json whose pid still runs with the recorded kernel start time, and starts the others.

Limits: one machine, loopback addresses; changing the engine set restarts the weight-sync origin (a rollout in
flight is cut short; the origin's reconcile loop reloads any engine left behind); a removed rollout worker's prompt
leases expire after the worker's `lease_s` before another worker regenerates them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from pathlib import Path
from typing import Any

from miles.common.errors import InvalidArgumentError
from miles.common.http_client import traced_async_client
from miles.common.jobspec.job import JobSpec
from miles.controller.backends import local_layout as layout
from miles.controller.backends.base import JobPhase, JobProgress, SharedServices
from miles.controller.backends.local_observe import TITO_CRITICAL_METRIC, StatusReaders
from miles.controller.backends.local_pool import RouterPool
from miles.controller.backends.local_processes import ProcessTable
from miles.controller.backends.local_shared_pools import SharedPoolRunner
from miles.controller.backends.local_state import LocalJob
from miles.controller.backends.local_supervise import ProcessSupervisor, RestartPolicy
from miles.proto.trainer.v1 import trainer_pb2

log = logging.getLogger(__name__)


class LocalJobBackend:
    """`JobBackend` running jobs as local processes. Options are keyword arguments (see `__init__`)."""

    name = "local"

    def __init__(
        self,
        shared: SharedServices,
        state_dir: Path,
        *,
        cwd: Path | None = None,
        stop_grace_s: float = 15.0,
        max_restarts: int = 5,
        restart_backoff_initial_s: float = 1.0,
        restart_backoff_max_s: float = 30.0,
        restart_reset_s: float = 60.0,
        monitor_interval_s: float = 1.0,
        engine_drain_timeout_s: float = 10.0,
    ) -> None:
        """`cwd`: working directory of every per-job process (relative dataset paths resolve there; default: the
        controller's). `stop_grace_s`: SIGTERM to SIGKILL. `engine_drain_timeout_s`: how long a removed engine
        drains at the router before it is stopped."""
        self.shared = shared
        self.state_dir = Path(state_dir)
        self.stop_grace_s = stop_grace_s
        self.monitor_interval_s = monitor_interval_s
        self.engine_drain_timeout_s = engine_drain_timeout_s
        self.table = ProcessTable(Path(cwd) if cwd is not None else Path.cwd())
        self.pool = RouterPool(shared.router_url, admin_token=shared.tokens.router_admin)
        self._http = traced_async_client(timeout=2.0)
        policy = RestartPolicy(max_restarts, restart_backoff_initial_s, restart_backoff_max_s, restart_reset_s)
        self.supervisor = ProcessSupervisor(self.table, self.pool, self._http, policy)
        self.shared_pools = SharedPoolRunner(
            shared.shared_pools, self.state_dir, self.supervisor, shared.tokens, monitor_interval_s=monitor_interval_s
        )
        self._jobs: dict[str, LocalJob] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self._monitors: dict[str, asyncio.Task[None]] = {}
        self.readers = StatusReaders(self._http, trainer_token=shared.tokens.trainer)

    # --- JobBackend ------------------------------------------------------------------------------------------
    async def check_spec(self, spec: JobSpec) -> None:
        problem = layout.unsupported(spec, self.shared)
        if problem is not None:
            field, why = problem
            raise InvalidArgumentError(why, field=field)

    async def start(self, job_id: str, spec: JobSpec, *, record_routing: bool | None = None) -> None:
        pool_name = spec.resources.engines.shared_pool
        if pool_name is not None and self.shared.shared_pool(pool_name) is not None:
            await self.shared_pools.ensure(pool_name)  # before the job's trainer loads its first adapter there
        async with self._lock(job_id):
            job = self._load(job_id)
            if job is not None and job.stopped and job.succeeded:
                return  # finished and stopped: a controller that died before recording the end asks again
            if job is not None and job.record_routing is None:  # a state.json written by an older controller
                job.record_routing = record_routing
            if job is None or job.stopped:
                job = LocalJob(job_id, self.job_dir(job_id), record_routing=record_routing)
                self._jobs[job_id] = job
                try:
                    self._plan(job, spec)
                except ValueError as exc:
                    job.failed, job.error = True, str(exc)
                    job.save()
                    return
            try:
                for record in job.processes.values():
                    if self.table.is_running(record):
                        log.info("adopted %s of job %s (pid %d)", record.name, job_id, record.pid)
                    elif not job.failed:
                        self.table.spawn(record, job.job_dir)
            finally:
                job.save()  # whatever was started is recorded, even when a later spawn failed
        self._ensure_monitor(job_id)

    async def observe(self, job_id: str, spec: JobSpec) -> JobProgress:
        job = self._load(job_id)
        if job is not None and job.stopped and job.succeeded:
            return JobProgress("succeeded", step=job.last_step, weight_version=job.last_weight_version)
        if job is None or job.stopped:
            return JobProgress(phase="failed", error=f"the local backend runs no processes for job {job_id}")
        async with self._lock(job_id):
            await self._supervise(job)
        trainers = job.by_role("trainer")
        status = await self.readers.trainer_status(job_id, trainers[0].url) if trainers else None
        if status is not None and (status.step, status.weight_version) != (job.last_step, job.last_weight_version):
            job.last_step, job.last_weight_version = int(status.step), int(status.weight_version)
            job.save()
        step, version = job.last_step, job.last_weight_version
        pool_name = spec.resources.engines.shared_pool
        own_engines = sum(1 for r in job.by_role("engine") if r.ready and self.table.is_running(r))
        pools = {
            "engines": self.shared_pools.ready_engines(pool_name) if pool_name else own_engines,
            "rollout_workers": sum(1 for r in job.by_role("worker") if self.table.is_running(r)),
            "trainer": sum(1 for r in job.by_role("trainer") if self.table.is_running(r)),
        }
        if spec.inference_pools:
            pools["inference_engines"] = sum(
                1 for r in job.by_role("inference") if r.ready and self.table.is_running(r)
            )
        metrics = dict(status.last_step_metrics) if status is not None else {}
        worker_urls = [record.url for record in job.by_role("worker") if record.ready]
        tito_critical = await self.readers.counter_sum(worker_urls, TITO_CRITICAL_METRIC)
        if tito_critical is not None:
            metrics["tito_critical_episodes"] = tito_critical
        phase: JobPhase = "running" if job.was_running else "starting"
        error = job.notice or (self.shared_pools.problem(pool_name) if pool_name else "")
        if job.failed:
            phase, error = "failed", job.error
        elif status is not None and status.state == trainer_pb2.TRAINER_STATE_FINISHED:
            # Not at step == num_steps: the trainer writes its final checkpoint after that step's Status, and a
            # job reported succeeded is stopped (its processes killed) before that checkpoint would be durable.
            phase, error = "succeeded", ""
            if not job.succeeded:
                job.succeeded = True
                job.save()
        finished_ms = int(status.last_step_finished_unix_ms) if status is not None else 0
        return JobProgress(
            phase,
            step=step,
            weight_version=version,
            error=error,
            pools=pools,
            metrics=metrics,
            step_finished_unix_ms=finished_ms if status is not None and status.weight_version == version else 0,
        )

    async def resize(self, job_id: str, spec: JobSpec, *, engines: int | None, rollout_workers: int | None) -> None:
        async with self._lock(job_id):
            job = self._load(job_id)
            if job is None or job.stopped or job.failed:
                return
            if engines is not None and not job.shared_pool and engines != len(job.by_role("engine")):
                await self._resize_engines(job, spec, engines)
            if rollout_workers is not None:
                await self._resize_workers(job, spec, rollout_workers)
            job.save()

    async def stop(self, job_id: str) -> None:
        monitor = self._monitors.pop(job_id, None)
        if monitor is not None:
            monitor.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await monitor
        async with self._lock(job_id):
            job = self._load(job_id)
            if job is None:
                return
            for engine in job.by_role("engine"):  # a job on a shared pool has none: the pool outlives it
                await self.pool.deregister(job_id, engine.url)
            for engine in job.by_role("inference"):
                await self.pool.deregister(str(engine.extra["router_pool"]), engine.url)
            records = list(job.processes.values())
            await asyncio.to_thread(self.table.stop_all, records, self.stop_grace_s)
            for record in records:
                (job.job_dir / f"{record.name}.pid").unlink(missing_ok=True)
            job.stopped = True
            job.save()
            await self.readers.forget(job_id)
            self._jobs.pop(job_id, None)

    async def close(self) -> None:
        monitors = list(self._monitors.values())
        self._monitors.clear()
        for monitor in monitors:
            monitor.cancel()
        for monitor in monitors:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await monitor
        await self.shared_pools.close()
        await self.readers.close()
        await self.pool.close()
        await self._http.aclose()

    # --- what else the controller may read -------------------------------------------------------------------
    def job_dir(self, job_id: str) -> Path:
        return self.state_dir / "jobs" / job_id

    def endpoints(self, job_id: str) -> dict[str, Any]:
        """URLs of the job's processes (engines, workers, trainer gRPC and metrics) for status scraping."""
        job = self._load(job_id)
        if job is None:
            return {}
        trainer = job.by_role("trainer")
        engines = [record.url for record in job.by_role("engine")]
        return {
            "engines": self.shared_pools.engine_urls(job.shared_pool) if job.shared_pool else engines,
            "rollout_workers": [record.url for record in job.by_role("worker")],
            "trainer_address": trainer[0].url if trainer else "",
            "trainer_metrics_url": f"http://127.0.0.1:{trainer[0].extra['metrics_port']}" if trainer else "",
            "weightsync_address": next((r.url for r in job.by_role("weightsync")), ""),
        }

    def pids(self, job_id: str) -> dict[str, int]:
        """Pid of every live process of the job by process name."""
        job = self._load(job_id)
        if job is None:
            return {}
        return {name: r.pid for name, r in job.processes.items() if self.table.is_running(r)}

    # --- internals -------------------------------------------------------------------------------------------
    def _lock(self, job_id: str) -> asyncio.Lock:
        return self._locks.setdefault(job_id, asyncio.Lock())

    def _load(self, job_id: str) -> LocalJob | None:
        job = self._jobs.get(job_id)
        if job is None:
            job = LocalJob.load(job_id, self.job_dir(job_id))
            if job is not None:
                self._jobs[job_id] = job
        return job

    def _plan(self, job: LocalJob, spec: JobSpec) -> None:
        """The records of every process of a new job (nothing is started here); ValueError for a spec the local
        backend cannot run (one accepted before check_spec existed, or by another controller version)."""
        problem = layout.unsupported(spec, self.shared)
        if problem is not None:
            raise ValueError(problem[1])
        job.job_dir.mkdir(parents=True, exist_ok=True)
        job.shared_pool = spec.resources.engines.shared_pool or ""
        engines = [
            layout.engine_record(job.job_dir, spec, i, self.shared.tokens, record_routing=job.record_routing)
            for i in range(0 if job.shared_pool else spec.resources.engines.replicas)
        ]
        records = list(engines)
        origin = ""
        if layout.uses_weightsync(spec):
            weightsync = layout.weightsync_record(
                job.job_dir, job.job_id, spec, self.shared, [engine.url for engine in engines]
            )
            records.append(weightsync)
            origin = weightsync.url
        records += layout.inference_engine_records(job.job_dir, job.job_id, spec, self.shared.tokens)
        records += [
            layout.worker_record(job.job_dir, job.job_id, spec, self.shared, i)
            for i in range(spec.resources.rollout_workers.replicas)
        ]
        records.append(layout.trainer_record(job.job_dir, job.job_id, spec, self.shared, origin))
        job.processes = {record.name: record for record in records}

    def _ensure_monitor(self, job_id: str) -> None:
        running = self._monitors.get(job_id)
        if running is None or running.done():
            self._monitors[job_id] = asyncio.create_task(self._monitor(job_id), name=f"local-monitor-{job_id}")

    async def _monitor(self, job_id: str) -> None:
        while True:
            await asyncio.sleep(self.monitor_interval_s)
            job = self._jobs.get(job_id)
            if job is None or job.stopped:
                return
            try:
                async with self._lock(job_id):
                    await self._supervise(job)
            except Exception:
                log.exception("supervision pass of job %s failed", job_id)

    async def _supervise(self, job: LocalJob) -> None:
        await self.supervisor.supervise(job)

    async def _resize_engines(self, job: LocalJob, spec: JobSpec, count: int) -> None:
        current = job.by_role("engine")
        if count > len(current):
            for _ in range(count - len(current)):
                index = job.next_index("engine")
                record = layout.engine_record(
                    job.job_dir, spec, index, self.shared.tokens, record_routing=job.record_routing
                )
                job.processes[record.name] = record
                self.table.spawn(record, job.job_dir)
        else:
            removed = current[count:]
            for record in removed:
                await self.pool.deregister(job.job_id, record.url, drain_timeout_s=self.engine_drain_timeout_s)
            await asyncio.to_thread(self.table.stop_all, removed, self.stop_grace_s)
            for record in removed:
                del job.processes[record.name]
                (job.job_dir / f"{record.name}.pid").unlink(missing_ok=True)
        await self._restart_weightsync(job, spec)

    async def _restart_weightsync(self, job: LocalJob, spec: JobSpec) -> None:
        """The origin learns the new engine set (its engine list is fixed at start-up): new config, restart. (nccl
        and disk jobs have no origin: the trainer finds engines in the router pool at each publish.)"""
        weightsync = job.processes.get("weightsync")
        if weightsync is None:
            return
        engine_urls = [record.url for record in job.by_role("engine")]
        layout.write_weightsync_config(job.job_dir, job.job_id, spec, self.shared, weightsync, engine_urls)
        await asyncio.to_thread(self.table.stop_all, [weightsync], self.stop_grace_s)
        self.table.spawn(weightsync, job.job_dir)

    async def _resize_workers(self, job: LocalJob, spec: JobSpec, count: int) -> None:
        current = job.by_role("worker")
        for _ in range(count - len(current)):
            record = layout.worker_record(job.job_dir, job.job_id, spec, self.shared, job.next_index("worker"))
            job.processes[record.name] = record
            self.table.spawn(record, job.job_dir)
        removed = current[count:] if count < len(current) else []
        await asyncio.to_thread(self.table.stop_all, removed, self.stop_grace_s)
        for record in removed:
            del job.processes[record.name]
            (job.job_dir / f"{record.name}.pid").unlink(missing_ok=True)
