"""The controller's core (no web framework): submit, read, cancel, resize and delete jobs, and follow their events.

The API writes intent into Redis (a new job, `cancel_requested`, new pool sizes) and wakes the supervisor, which
does the work with the backend; so every request is answered from Redis and survives a controller restart.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import time
from collections.abc import AsyncIterator

from miles.common.contracts.adapters import VERSIONS_LOADED_PER_JOB
from miles.common.errors import InvalidArgumentError, MilesError, ResourceExhaustedError
from miles.common.jobspec.job import JobSpec
from miles.controller.api_models import ResizeRequest
from miles.controller.backends.base import SharedPool
from miles.controller.errors import JobNotFoundError, JobStateConflictError
from miles.controller.evals import delete_evals
from miles.controller.jobs import TERMINAL_STATES, JobRecord, JobState, new_job_id
from miles.controller.lora_check import check_lora, check_shared_pool, read_config
from miles.controller.metrics import ControllerMetrics
from miles.controller.routing_replay import check_routing_replay, read_model_routing
from miles.controller.settings import ControllerSettings
from miles.controller.store import JobEvent, JobStore
from miles.controller.supervisor import Supervisor

EVENT_POLL_BLOCK_MS = 1000
LIST_PAGE_SIZE = 500
TERMINAL_VALUES = frozenset(state.value for state in TERMINAL_STATES)
log = logging.getLogger(__name__)


class JobService:
    def __init__(
        self, *, store: JobStore, supervisor: Supervisor, settings: ControllerSettings, metrics: ControllerMetrics
    ) -> None:
        self.store = store
        self.supervisor = supervisor
        self.settings = settings
        self.metrics = metrics

    async def submit(self, spec: JobSpec, *, idempotency_key: str | None = None) -> tuple[JobRecord, bool]:
        """Store a new PENDING job; returns (job, created). With an idempotency key already used for the same
        spec, returns that job and created=False."""
        for field, why in [*spec.train.recipe_problems(), *spec.placement_problems()]:  # semantic: pydantic
            raise InvalidArgumentError(why, field=field)  # accepted each field on its own
        check_routing_replay(spec, await asyncio.to_thread(read_model_routing, spec.model.path))
        if spec.train.lora is not None:
            check_lora(spec, await asyncio.to_thread(read_config, spec.model.path))
        pool = check_shared_pool(spec, self.settings.shared_pools)
        await self.supervisor.backend.check_spec(spec)
        if pool is not None:
            await self._check_pool_capacity(pool)
        now = time.time()
        record = JobRecord(job_id=new_job_id(), spec=spec, state=JobState.PENDING, created_at_s=now, updated_at_s=now)
        canonical = spec.model_dump_json().encode()
        event = {"type": "state", "state": "PENDING", "job_id": record.job_id, "reason": "submitted"}
        job_id, created = await self.store.create(
            record,
            event,
            max_active=self.settings.max_active_jobs,
            idempotency_key=idempotency_key,
            body_hash=hashlib.sha256(canonical).hexdigest(),
            idempotency_ttl_s=self.settings.idempotency_ttl_s,
        )
        if created:
            self.metrics.jobs_submitted.inc()
            self.supervisor.wake()
            return record, True
        self.metrics.idempotent_replays.inc()
        return await self.store.get(job_id), False

    async def get(self, job_id: str) -> JobRecord:
        return await self.store.get(job_id)

    async def _check_pool_capacity(self, pool: SharedPool) -> None:
        """429 when the pool's adapter slots are taken by active jobs (each keeps VERSIONS_LOADED_PER_JOB versions
        loaded). Counted before the job is stored, so two submissions at the same instant may both pass: the engines
        then refuse the extra load, and the later job's trainer reports it."""
        capacity = pool.max_loaded_loras // VERSIONS_LOADED_PER_JOB
        on_pool = 0
        for job_id in await self.store.active_job_ids():
            with contextlib.suppress(JobNotFoundError):  # deleted meanwhile
                record = await self.store.get(job_id)
                on_pool += record.spec.resources.engines.shared_pool == pool.name and not record.state.is_terminal
        if on_pool >= capacity:
            raise ResourceExhaustedError(
                f"shared pool {pool.name!r} already runs {on_pool} LoRA jobs, all its max_loaded_loras "
                f"{pool.max_loaded_loras} adapter slots allow ({VERSIONS_LOADED_PER_JOB} versions per job); wait for "
                "one to end",
                retry_after_s=30.0,
            )

    async def list(self, *, limit: int, offset: int, state: JobState | None) -> list[JobRecord]:
        if state is None:
            return await self.store.list_jobs(limit=limit, offset=offset)
        matching: list[JobRecord] = []
        position = 0
        while len(matching) < offset + limit:  # scan pages; job counts are small (deleted jobs leave the index)
            page = await self.store.list_jobs(limit=LIST_PAGE_SIZE, offset=position)
            matching += [record for record in page if record.state is state]
            if len(page) < LIST_PAGE_SIZE:
                break
            position += LIST_PAGE_SIZE
        return matching[offset : offset + limit]

    async def cancel(self, job_id: str) -> JobRecord:
        """Ask the supervisor to stop the job; waits up to cancel_wait_s for CANCELLED. Cancelling a cancelled
        job is a no-op; cancelling one that SUCCEEDED or FAILED is a conflict."""
        record = await self.store.get(job_id)
        if record.state is JobState.CANCELLED:
            return record
        if record.state.is_terminal:
            raise JobStateConflictError(f"job {job_id} already ended ({record.state.value}); nothing to cancel")
        if not record.cancel_requested:
            event = {"type": "cancel_requested", "job_id": job_id}
            await self.store.update(job_id, {"cancel_requested": "1"}, event)
        self.supervisor.wake(job_id)
        deadline = time.monotonic() + self.settings.cancel_wait_s
        while True:
            record = await self.store.get(job_id)
            if record.state.is_terminal or time.monotonic() >= deadline:
                return record
            await asyncio.sleep(0.05)

    async def resize(self, job_id: str, request: ResizeRequest) -> JobRecord:
        """Record new engine / rollout-worker pool sizes; the supervisor applies them (backend.resize)."""
        record = await self.store.get(job_id)
        if record.state.is_terminal or record.cancel_requested:
            raise JobStateConflictError(f"job {job_id} is {record.state.value}: only an active job can be resized")
        if record.spec.kueue is not None:
            raise InvalidArgumentError(
                f"job {job_id} is admitted by Kueue (queue {record.spec.kueue.queue_name!r}) for the pool sizes it was "
                "submitted with: cancel it and submit it again with the new sizes",
                field="kueue",
            )
        pool_name = record.spec.resources.engines.shared_pool
        if pool_name is not None and request.engines is not None:
            raise InvalidArgumentError(
                f"job {job_id} runs on shared engine pool {pool_name!r} and has no engines of its own: the platform "
                "sizes the pool (controller setting shared_pools)",
                field="engines",
            )
        spec_data = record.spec.model_dump(mode="json")
        resources = spec_data["resources"]
        if request.engines is not None:
            resources["engines"]["replicas"] = request.engines
        if request.rollout_workers is not None:
            workers = resources["rollout_workers"]
            workers["replicas"] = request.rollout_workers
            if workers.get("max_replicas") is not None:  # as the autoscaler's maximum is raised (kubernetes.py)
                workers["max_replicas"] = max(workers["max_replicas"], request.rollout_workers)
        new_spec = JobSpec.model_validate(spec_data)
        event = {
            "type": "resize_requested",
            "job_id": job_id,
            "engines": new_spec.resources.engines.replicas,
            "rollout_workers": new_spec.resources.rollout_workers.replicas,
        }
        await self.store.update(job_id, {"spec": new_spec.model_dump_json(), "resize_pending": "1"}, event)
        self.supervisor.wake(job_id)
        return await self.store.get(job_id)

    async def delete(self, job_id: str) -> None:
        """Delete an ended job's record, events and shared-service registrations (409 while it is active)."""
        record = await self.store.get(job_id)
        await self.store.delete(job_id)
        await delete_evals(self.store.redis, job_id)
        try:
            await self.supervisor.shared.unregister(job_id, record.spec)
        except MilesError as exc:  # the job is gone; its leftovers expire or are overwritten by nothing
            log.warning("could not unregister a deleted job", extra={"job_id": job_id, "error": exc.message})

    async def follow(self, job_id: str, *, after_id: str) -> AsyncIterator[JobEvent | None]:
        """The job's events after `after_id`, then new ones as they come, until the job has ended and every event
        is out. Yields None when nothing happened for a while (the transport sends a keep-alive)."""
        await self.store.get(job_id)  # 404 before the stream starts
        last_id = after_id
        idle_s = 0.0
        while True:
            events = await self.store.events(job_id, after_id=last_id, block_ms=EVENT_POLL_BLOCK_MS)
            for event in events:
                last_id = event.event_id
                yield event
                if event.type == "state" and event.data.get("state") in TERMINAL_VALUES:
                    return
            if events:
                idle_s = 0.0
                continue
            try:
                record = await self.store.get(job_id)
            except JobNotFoundError:
                return
            if record.state.is_terminal:
                return
            idle_s += EVENT_POLL_BLOCK_MS / 1000
            if idle_s >= self.settings.sse_keepalive_s:
                idle_s = 0.0
                yield None
