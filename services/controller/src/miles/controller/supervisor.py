"""The job supervisor: drives every active job through its state machine with the backend.

One replica at a time supervises (a lease in Redis); it runs one task per active job:

    register with the shared services -> backend.start -> every observe_interval_s: backend.observe
       phase running  -> RUNNING;  phase succeeded -> SUCCEEDED;  phase failed -> FAILED
       phase queued   -> QUEUED (waiting for Kueue's admission, or preempted by it; `start_timeout_s` does not run)
    cancel requested  -> backend.stop -> CANCELLED;  resize requested -> backend.resize

Restart-safe by construction: all intent (cancel, resize) and all state is in Redis, and `register` and
`backend.start` are idempotent, so a new supervisor (after a restart, or on another replica once the lease
expires) re-adopts every PENDING/QUEUED/RUNNING job by running the same steps again: the backend adopts what still runs.
Limit: a job whose lease-holder died is not watched until the lease expires (`leader_lease_s`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import Awaitable
from typing import Any, TypeVar

from miles.common.aio import wait_event
from miles.common.errors import MilesError
from miles.controller.backends.base import JobBackend, JobProgress
from miles.controller.errors import IllegalTransitionError, JobNotFoundError
from miles.controller.evals import EvalAnnouncer, record_version_step
from miles.controller.health import MAX_REWARDS_KEPT, policy_reward
from miles.controller.jobs import MAX_ERRORS_KEPT, JobRecord, JobState
from miles.controller.metrics import ControllerMetrics
from miles.controller.settings import ControllerSettings
from miles.controller.shared import SharedServicesClient
from miles.controller.store import JobStore

log = logging.getLogger(__name__)
T = TypeVar("T")


def _describe(exc: BaseException) -> str:
    return exc.message if isinstance(exc, MilesError) else f"{type(exc).__name__}: {exc}"


class _JobEndedError(Exception):
    """Internal: the job reached a terminal state (or was deleted); its task ends."""


class Supervisor:
    def __init__(
        self,
        *,
        store: JobStore,
        backend: JobBackend,
        shared: SharedServicesClient,
        settings: ControllerSettings,
        metrics: ControllerMetrics,
    ) -> None:
        self.store = store
        self.backend = backend
        self.shared = shared
        self.settings = settings
        self.metrics = metrics
        self.holder_id = uuid.uuid4().hex
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._wake_events: dict[str, asyncio.Event] = {}
        self._wake_loop = asyncio.Event()
        self.is_leader = False

    def wake(self, job_id: str | None = None) -> None:
        """Act on a job (or look for new jobs) now instead of at the next tick (in-process only)."""
        self._wake_loop.set()
        if job_id is not None and job_id in self._wake_events:
            self._wake_events[job_id].set()

    async def run(self, stop: asyncio.Event) -> None:
        """The main loop: hold the lease, start a task per active job, until `stop` is set."""
        tick_s = min(self.settings.observe_interval_s, self.settings.leader_lease_s / 3)
        while not stop.is_set():
            try:
                await self._tick()
            except MilesError as exc:
                log.warning("supervisor tick failed", extra={"error": _describe(exc)})
            except Exception:  # the loop must outlive any one bad tick: jobs depend on it
                log.exception("supervisor tick failed unexpectedly")
            self._wake_loop.clear()
            await wait_event(self._wake_loop, tick_s)

    async def _tick(self) -> None:
        self.is_leader = await self.store.acquire_lease(self.holder_id, self.settings.leader_lease_s)
        self.metrics.is_leader.set(1 if self.is_leader else 0)
        if not self.is_leader:
            await self._cancel_tasks()
            return
        active = await self.store.active_job_ids()
        self.metrics.active_jobs.set(len(active))
        for job_id in active:
            task = self._tasks.get(job_id)
            if task is None or task.done():
                self._wake_events[job_id] = asyncio.Event()
                self._tasks[job_id] = asyncio.create_task(self._supervise(job_id), name=f"supervise-{job_id}")
        for job_id in [job_id for job_id, task in self._tasks.items() if task.done()]:
            del self._tasks[job_id]
            self._wake_events.pop(job_id, None)
        self.metrics.supervised_jobs.set(len(self._tasks))

    async def close(self) -> None:
        """Stop supervising (per-job resources keep running) and hand the lease back."""
        await self._cancel_tasks()
        with contextlib.suppress(MilesError):
            await self.store.release_lease(self.holder_id)
        self.metrics.is_leader.set(0)

    async def _cancel_tasks(self) -> None:
        tasks = list(self._tasks.values())
        # Cleared first: a supervise loop whose cancellation got lost still ends at its next wait (no wake event).
        self._tasks.clear()
        self._wake_events.clear()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _supervise(self, job_id: str) -> None:
        """One job from adoption to a terminal state."""
        state = _JobLoopState()
        try:
            while True:
                await self._step(job_id, state)
                event = self._wake_events.get(job_id)
                if event is None:
                    return
                await wait_event(event, self.settings.observe_interval_s)
                event.clear()
        except _JobEndedError:
            return
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("supervising job failed; retrying at the next tick", extra={"job_id": job_id})

    async def _step(self, job_id: str, loop: _JobLoopState) -> None:
        try:
            record = await self.store.get(job_id)
        except JobNotFoundError:
            raise _JobEndedError from None
        if record.state.is_terminal:
            raise _JobEndedError
        if record.cancel_requested:
            await self._call("stop", self.backend.stop(job_id))
            await self._end(record, JobState.CANCELLED, "cancelled by request")
        if not loop.started:
            await self._start(record, loop)
        else:
            await self._observe(record, loop)
        if record.state is JobState.PENDING and time.time() - record.created_at_s > self.settings.start_timeout_s:
            await self._fail(record, f"resources not running after start_timeout_s={self.settings.start_timeout_s}")

    async def _start(self, record: JobRecord, loop: _JobLoopState) -> None:
        try:
            # Registration first: the backend's engines need the routing the session server resolved from the model.
            record_routing = await self._call("register", self.shared.register(record.job_id, record.spec))
            await self._call("start", self.backend.start(record.job_id, record.spec, record_routing=record_routing))
        except MilesError as exc:
            loop.start_failures += 1
            if not exc.retryable or loop.start_failures >= self.settings.max_start_attempts:
                await self._fail(record, f"could not start: {_describe(exc)}")
            await self._note_error(record, f"start attempt {loop.start_failures} failed: {_describe(exc)}")
            return
        except Exception as exc:
            loop.start_failures += 1
            if loop.start_failures >= self.settings.max_start_attempts:
                await self._fail(record, f"could not start: {_describe(exc)}")
            await self._note_error(record, f"start attempt {loop.start_failures} failed: {_describe(exc)}")
            return
        loop.started = True
        await self.store.update(record.job_id, {}, {"type": "started", "job_id": record.job_id})

    async def _observe(self, record: JobRecord, loop: _JobLoopState) -> None:
        job_id, spec = record.job_id, record.spec
        try:
            if record.resize_pending:
                resources = spec.resources
                await self._call(
                    "resize",
                    self.backend.resize(
                        job_id,
                        spec,
                        engines=resources.engines.replicas,
                        rollout_workers=resources.rollout_workers.replicas,
                    ),
                )
                event = {
                    "type": "resized",
                    "job_id": job_id,
                    "engines": resources.engines.replicas,
                    "rollout_workers": resources.rollout_workers.replicas,
                }
                await self.store.resize_applied(job_id, record.spec_json, event)
            progress = await self._call("observe", self.backend.observe(job_id, spec))
        except Exception as exc:
            loop.observe_failures += 1
            await self._note_error(record, f"observe failed ({loop.observe_failures} in a row): {_describe(exc)}")
            if loop.observe_failures >= self.settings.max_observe_failures:
                await self._fail(record, f"lost track of the job: {_describe(exc)}")
            return
        loop.observe_failures = 0
        await self._record_progress(record, progress, loop)
        if progress.phase == "failed":
            await self._fail(record, progress.error or "the backend reports the job failed")
        if progress.phase == "queued" and record.state is not JobState.QUEUED:
            await self._queue(record, progress.error or "waiting for admission")
        if progress.phase in ("running", "succeeded") and record.state in (JobState.PENDING, JobState.QUEUED):
            await self.store.transition(
                job_id,
                JobState.RUNNING,
                {"type": "state", "state": "RUNNING", "previous": record.state.value, "job_id": job_id},
                {"started_at_s": repr(time.time())},
            )
        if progress.phase == "succeeded":
            await self._call("stop", self.backend.stop(job_id))
            await self._end(record, JobState.SUCCEEDED, f"finished {progress.step} steps")

    async def _queue(self, record: JobRecord, reason: str) -> None:
        """PENDING or RUNNING -> QUEUED (Kueue: not admitted yet, or preempted); a preemption is also an error."""
        if record.state is JobState.RUNNING:
            await self._note_error(record, f"suspended: {reason}")
        event = {
            "type": "state",
            "state": "QUEUED",
            "previous": record.state.value,
            "job_id": record.job_id,
            "reason": reason,
        }
        await self.store.transition(record.job_id, JobState.QUEUED, event)

    async def _record_progress(self, record: JobRecord, progress: JobProgress, loop: _JobLoopState) -> None:
        metrics = {**record.metrics, **progress.metrics, **await self.shared.router_stats(record.job_id, record.spec)}
        fields = {
            "step": str(progress.step),
            "weight_version": str(progress.weight_version),
            "pools": _json(progress.pools),
            "metrics": _json(metrics),
        }
        reward = policy_reward(progress.metrics)
        if progress.step > record.step and reward is not None:
            fields["rewards"] = _json([*record.rewards, reward][-MAX_REWARDS_KEPT:])
        seen = (progress.phase, progress.step, progress.weight_version, tuple(sorted(progress.pools.items())))
        event: dict[str, Any] | None = None
        if seen != loop.last_seen:
            loop.last_seen = seen
            event = {
                "type": "progress",
                "job_id": record.job_id,
                "phase": progress.phase,
                "step": progress.step,
                "num_steps": record.spec.train.num_steps,
                "weight_version": progress.weight_version,
                "pools": progress.pools,
                "metrics": metrics,
            }
        await self.store.update(record.job_id, fields, event)
        await self._note_version_step(record.job_id, progress, loop)
        await self._announce_evals(record, loop)  # the job's own evaluation, or an external evaluator's
        await self._watch_for_stall(record, progress, loop)

    async def _note_version_step(self, job_id: str, progress: JobProgress, loop: _JobLoopState) -> None:
        """Remember when the step behind each new weight version finished (evaluations' step-to-score time); a
        Redis hiccup is retried at the next observe."""
        if not progress.step_finished_unix_ms or progress.weight_version == loop.step_time_version:
            return
        try:
            await record_version_step(self.store.redis, job_id, progress.weight_version, progress.step_finished_unix_ms)
            loop.step_time_version = progress.weight_version
        except Exception as exc:
            log.warning("recording a version's step time failed", extra={"job_id": job_id, "error": str(exc)})

    async def _announce_evals(self, record: JobRecord, loop: _JobLoopState) -> None:
        """An `eval` event per newly stored evaluation version (one HLEN per observation while nothing is new); a
        Redis hiccup is retried at the next observe."""
        try:
            for eval_event in await loop.evals.new_events(self.store.redis, record.job_id):
                await self.store.update(record.job_id, {}, eval_event)
        except Exception as exc:
            log.warning("reading evaluation results failed", extra={"job_id": record.job_id, "error": str(exc)})

    async def _watch_for_stall(self, record: JobRecord, progress: JobProgress, loop: _JobLoopState) -> None:
        """Say so (errors, an event) when a running job trains nothing for a while; say when it resumes."""
        now_s = time.monotonic()
        if progress.phase != "running" or loop.last_step_at_s == 0.0 or progress.step != loop.last_step:
            if loop.stalled and progress.step != loop.last_step:
                stalled_s = round(now_s - loop.last_step_at_s)
                event = {"type": "resumed", "job_id": record.job_id, "step": progress.step, "stalled_s": stalled_s}
                await self.store.update(record.job_id, {}, event)
            if loop.last_step_at_s and progress.step > loop.last_step:
                loop.step_interval_s = (now_s - loop.last_step_at_s) / (progress.step - loop.last_step)
            loop.last_step, loop.last_step_at_s, loop.stalled = progress.step, now_s, False
            return
        bound_s = max(self.settings.stall_warning_s, 4 * loop.step_interval_s)
        if loop.stalled or now_s - loop.last_step_at_s < bound_s:
            return
        loop.stalled = True
        await self._note_error(
            record,
            f"stalled: no step trained for {now_s - loop.last_step_at_s:.0f}s (step {progress.step}/"
            f"{record.spec.train.num_steps}); pools {progress.pools}; "
            f"{progress.error or 'no process problem reported by the backend'}",
        )

    async def _fail(self, record: JobRecord, reason: str) -> None:
        await self._note_error(record, reason)
        with contextlib.suppress(Exception):
            await self._call("stop", self.backend.stop(record.job_id))
        await self._end(record, JobState.FAILED, reason)

    async def _end(self, record: JobRecord, state: JobState, reason: str) -> None:
        event = {"type": "state", "state": state.value, "job_id": record.job_id, "reason": reason}
        try:
            previous = await self.store.transition(record.job_id, state, event, {"ended_at_s": repr(time.time())})
        except (IllegalTransitionError, JobNotFoundError):
            raise _JobEndedError from None
        log.info("job ended", extra={"job_id": record.job_id, "state": state.value, "previous": previous.value})
        self.metrics.jobs_ended.labels(state.value).inc()
        raise _JobEndedError

    async def _note_error(self, record: JobRecord, message: str) -> None:
        log.warning("job problem", extra={"job_id": record.job_id, "error": message})
        record.errors = [*record.errors, message][-MAX_ERRORS_KEPT:]
        event = {"type": "error", "job_id": record.job_id, "message": message}
        await self.store.update(record.job_id, {"errors": _json(record.errors)}, event)

    async def _call(self, operation: str, awaitable: Awaitable[T]) -> T:
        started = time.perf_counter()
        try:
            result = await awaitable
        except Exception:
            self.metrics.backend_calls.labels(operation, "error").inc()
            raise
        finally:
            self.metrics.backend_call_duration_s.labels(operation).observe(time.perf_counter() - started)
        self.metrics.backend_calls.labels(operation, "ok").inc()
        return result


class _JobLoopState:
    """What one job's task remembers between steps (lost on restart, which is fine: it is all re-derivable)."""

    def __init__(self) -> None:
        self.started = False
        self.start_failures = 0
        self.observe_failures = 0
        self.last_seen: tuple[Any, ...] = ()
        self.last_step = 0
        self.last_step_at_s = 0.0
        """When the step last changed (monotonic; 0: not yet observed running)."""
        self.step_interval_s = 0.0
        self.stalled = False
        self.step_time_version = -1
        """The last weight version whose step time was recorded."""
        self.evals = EvalAnnouncer()
        """Evaluation versions already announced as `eval` events."""


def _json(value: Any) -> str:
    return json.dumps(value)
