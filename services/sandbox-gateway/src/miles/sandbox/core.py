"""The sandbox-gateway core: ids, validation, per-job quotas, TTL reaper, warm pool and metrics over one backend.

Transport-free (gRPC and HTTP call the same methods). Every request is validated (validation.py) before the
backend sees it. A sandbox is destroyed by Destroy, by the reaper once it has been idle (no exec running, no
call) for its ttl_s, by the reaper when the backend reports it dead, or at shutdown. Quotas count live sandboxes
plus creations in flight, so that concurrent Creates cannot overshoot them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass

from miles.sandbox.backend import SandboxBackend
from miles.sandbox.errors import FileTooLargeError, InvalidSandboxRequestError, QuotaExceededError, SandboxNotFoundError
from miles.sandbox.metrics import SandboxMetrics
from miles.sandbox.models import (
    CreatedSandbox,
    CreateParams,
    ExecEvent,
    ExecParams,
    ExecResult,
    ExecSpec,
    FileContent,
    LimitKind,
    NetworkMode,
    SandboxInfo,
    SandboxSpec,
)
from miles.sandbox.settings import SandboxSettings
from miles.sandbox.validation import path_components, resolve_create, resolve_exec
from miles.sandbox.warm_pool import WarmPool, new_sandbox_id

log = logging.getLogger(__name__)

DEFAULT_FILE_MODE = 0o644


@dataclass
class _Record:
    """What the gateway knows about one live sandbox."""

    sandbox_id: str
    job_id: str
    spec: SandboxSpec
    env: dict[str, str]
    ttl_s: float
    created_at_unix_ms: int
    last_used_s: float
    last_used_unix_ms: int
    active_execs: int = 0


class SandboxGateway:
    def __init__(
        self,
        settings: SandboxSettings,
        backend: SandboxBackend,
        metrics: SandboxMetrics,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.settings = settings
        self.backend = backend
        self.metrics = metrics
        self.clock = clock
        self._records: dict[str, _Record] = {}
        self._creating: Counter[str] = Counter()
        self._reaper: asyncio.Task[None] | None = None
        self._closing = False
        self.pool: WarmPool | None = None
        if settings.warm_pool_size > 0:
            pool_spec, _, _ = resolve_create(CreateParams(), settings, allowlist_supported=False)
            self.pool = WarmPool(backend, pool_spec, settings.warm_pool_size, metrics)

    # -- lifecycle ---------------------------------------------------------------------------------------------

    async def start(self) -> None:
        """Start the backend (raises BackendUnusableError when it cannot work here), the reaper and the pool."""
        await self.backend.start()
        self._reaper = asyncio.create_task(self._reap_forever(), name="sandbox-reaper")
        if self.pool is not None:
            self.pool.start()
        self._update_live_gauge()

    async def close(self) -> None:
        self._closing = True  # besides the cancel: Python 3.11's wait_for can swallow a cancel (gh-86296)
        if self._reaper is not None:
            self._reaper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reaper
        if self.pool is not None:
            await self.pool.close()
        for sandbox_id in list(self._records):
            await self._destroy(sandbox_id, reason="shutdown")
        await self.backend.close()

    # -- API ---------------------------------------------------------------------------------------------------

    async def create(self, params: CreateParams) -> CreatedSandbox:
        start_s = time.perf_counter()
        spec, ttl_s, env = resolve_create(
            params, self.settings, allowlist_supported=self.backend.supports_egress_allowlist
        )
        self._check_quotas(params.job_id)
        self._creating[params.job_id] += 1
        try:
            sandbox_id, warm = await self._start_sandbox(spec)
        finally:
            self._creating[params.job_id] -= 1
            if self._creating[params.job_id] == 0:
                del self._creating[params.job_id]
        now_ms = int(time.time() * 1000)
        self._records[sandbox_id] = _Record(sandbox_id, params.job_id, spec, env, ttl_s, now_ms, self.clock(), now_ms)
        startup_s = time.perf_counter() - start_s
        source = "warm" if warm else "cold"
        self.metrics.startup_duration_s.labels(self.backend.name, source).observe(startup_s)
        self.metrics.sandboxes_created.labels(self.backend.name, source).inc()
        self._update_live_gauge()
        return CreatedSandbox(sandbox_id, self.backend.name, startup_s, spec.limits, warm)

    def _check_quotas(self, job_id: str) -> None:
        in_job = sum(1 for record in self._records.values() if record.job_id == job_id) + self._creating[job_id]
        if in_job >= self.settings.max_sandboxes_per_job:
            self.metrics.quota_rejections.labels("job").inc()
            raise QuotaExceededError(
                f"job {job_id!r} already has {in_job} live sandboxes (max_sandboxes_per_job="
                f"{self.settings.max_sandboxes_per_job}); destroy some first",
                field="job_id",
                retry_after_s=1.0,
            )
        total = len(self._records) + sum(self._creating.values())
        if total >= self.settings.max_sandboxes:
            self.metrics.quota_rejections.labels("gateway").inc()
            raise QuotaExceededError(
                f"the gateway already has {total} live sandboxes (max_sandboxes={self.settings.max_sandboxes})",
                retry_after_s=1.0,
            )

    async def _start_sandbox(self, spec: SandboxSpec) -> tuple[str, bool]:
        """(sandbox id, whether it came from the warm pool)."""
        poolable = spec.template_name == self.settings.default_template and spec.network.mode is NetworkMode.NONE
        if self.pool is not None and poolable:
            pooled_id = self.pool.take()
            if pooled_id is not None:
                if await self.backend.adopt(pooled_id, spec):
                    return pooled_id, True
                await self.backend.destroy(pooled_id)
        sandbox_id = new_sandbox_id()
        try:
            await self.backend.create(sandbox_id, spec)
        except Exception:
            self.metrics.create_failures.labels(self.backend.name).inc()
            raise
        return sandbox_id, False

    def _record(self, sandbox_id: str) -> _Record:
        record = self._records.get(sandbox_id)
        if record is None:
            raise SandboxNotFoundError.of(sandbox_id)
        return record

    def ensure_exists(self, sandbox_id: str) -> None:
        """Raise SandboxNotFoundError unless the sandbox is live."""
        self._record(sandbox_id)

    def job_of(self, sandbox_id: str) -> str | None:
        """The job_id a live sandbox was created for (None: no such live sandbox)."""
        record = self._records.get(sandbox_id)
        return record.job_id if record is not None else None

    def live_job_ids(self) -> set[str]:
        """The jobs that have live sandboxes or Creates in flight."""
        return {record.job_id for record in self._records.values()} | set(self._creating)

    def _touch(self, record: _Record) -> None:
        record.last_used_s = self.clock()
        record.last_used_unix_ms = int(time.time() * 1000)

    def open_exec(self, sandbox_id: str, params: ExecParams) -> AsyncGenerator[ExecEvent, None]:
        """Validate now (NOT_FOUND / INVALID_ARGUMENT raise here, before any output), run when iterated."""
        record = self._record(sandbox_id)
        spec = resolve_exec(params, sandbox_env=record.env, spec=record.spec, settings=self.settings)
        return self._run_exec(record, spec)

    async def _run_exec(self, record: _Record, spec: ExecSpec) -> AsyncGenerator[ExecEvent, None]:
        record.active_execs += 1
        self._touch(record)
        start_s = time.perf_counter()
        result: ExecResult | None = None
        outcome = "error"
        try:
            events = self.backend.exec(record.sandbox_id, spec)
            async with contextlib.aclosing(events):
                async for event in events:
                    if isinstance(event, ExecResult):
                        result = event
                        outcome = "exit0" if event.exit_code == 0 else ("signal" if event.signal else "nonzero")
                    yield event
        finally:
            record.active_execs -= 1
            self._touch(record)
            self.metrics.execs.labels(self.backend.name, outcome).inc()
            self.metrics.exec_duration_s.labels(self.backend.name).observe(time.perf_counter() - start_s)
            if result is not None:
                for kind in result.limits_hit:
                    self.metrics.limit_kills.labels(self.backend.name, kind.value).inc()
                if LimitKind.TIMEOUT in result.limits_hit:
                    self.metrics.exec_timeouts.labels(self.backend.name).inc()

    async def write_file(self, sandbox_id: str, path: str, data: bytes, mode: int) -> int:
        record = self._record(sandbox_id)
        parts = path_components(path, record.spec.workdir, field="path")
        if len(data) > self.settings.max_write_bytes:
            raise FileTooLargeError(
                f"data is {len(data)} bytes, above max_write_bytes={self.settings.max_write_bytes}", field="data"
            )
        if not 0 <= mode <= 0o777:
            raise InvalidSandboxRequestError(f"mode must be within 0..0o777, got {mode:#o}", field="mode")
        self._touch(record)
        return await self.backend.write_file(sandbox_id, parts, data, mode or DEFAULT_FILE_MODE)

    async def read_file(self, sandbox_id: str, path: str, max_bytes: int) -> FileContent:
        record = self._record(sandbox_id)
        parts = path_components(path, record.spec.workdir, field="path")
        if max_bytes < 0:
            raise InvalidSandboxRequestError("max_bytes must be >= 0 (0 = the gateway cap)", field="max_bytes")
        cap = min(max_bytes or self.settings.max_read_bytes, self.settings.max_read_bytes)
        self._touch(record)
        return await self.backend.read_file(sandbox_id, parts, cap)

    async def destroy(self, sandbox_id: str) -> bool:
        return await self._destroy(sandbox_id, reason="request")

    def list_sandboxes(self, job_id: str = "") -> list[SandboxInfo]:
        return [
            SandboxInfo(
                sandbox_id=record.sandbox_id,
                job_id=record.job_id,
                backend=self.backend.name,
                template=record.spec.template_name,
                created_at_unix_ms=record.created_at_unix_ms,
                last_used_unix_ms=record.last_used_unix_ms,
                ttl_s=record.ttl_s,
                limits=record.spec.limits,
                network_mode=record.spec.network.mode,
                active_execs=record.active_execs,
            )
            for record in self._records.values()
            if not job_id or record.job_id == job_id
        ]

    # -- internals ---------------------------------------------------------------------------------------------

    async def _destroy(self, sandbox_id: str, *, reason: str) -> bool:
        if self._records.pop(sandbox_id, None) is None:
            return False
        self._update_live_gauge()
        await self.backend.destroy(sandbox_id)
        self.metrics.sandboxes_destroyed.labels(self.backend.name, reason).inc()
        return True

    def _update_live_gauge(self) -> None:
        self.metrics.live_sandboxes.labels(self.backend.name).set(len(self._records))

    async def reap_once(self) -> list[str]:
        """Destroy sandboxes idle past their TTL and those the backend reports dead; returns their ids."""
        now_s = self.clock()
        expired = [
            (record.sandbox_id, "ttl")
            for record in self._records.values()
            if record.active_execs == 0 and now_s - record.last_used_s > record.ttl_s
        ]
        dead = [
            (sandbox_id, "dead")
            for sandbox_id, record in self._records.items()
            if record.active_execs == 0 and not self.backend.is_alive(sandbox_id)
        ]
        reaped: list[str] = []
        for sandbox_id, reason in dict(expired + dead).items():
            if await self._destroy(sandbox_id, reason=reason):
                reaped.append(sandbox_id)
        return reaped

    async def _reap_forever(self) -> None:
        while not self._closing:
            await asyncio.sleep(self.settings.reaper_interval_s)
            try:
                await self.reap_once()
            except Exception:  # the reaper must outlive one failing destroy; the next pass retries
                log.exception("sandbox reaper pass failed")
