"""A pool of started sandboxes of the default template, so that Create skips the start-up time.

The pool holds `size` sandboxes created from the default spec (default template, default limits, no network),
refilled in the background one at a time after each take. A Create that asks for the default template and no
network takes one and lets the backend `adopt` it to the requested limits (the local backend re-limits its
cgroups; backends that cannot re-limit refuse and the Create starts a sandbox cold). Pooled sandboxes belong to
no job, count in no quota and are destroyed at shutdown. A failing backend is retried with backoff (up to 30 s).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
from collections import deque

from miles.sandbox.backend import SandboxBackend
from miles.sandbox.metrics import SandboxMetrics
from miles.sandbox.models import SandboxSpec

log = logging.getLogger(__name__)

MAX_BACKOFF_S = 30.0


def new_sandbox_id() -> str:
    """16 lowercase hex characters: unguessable, and valid in DNS names and paths."""
    return secrets.token_hex(8)


class WarmPool:
    def __init__(self, backend: SandboxBackend, spec: SandboxSpec, size: int, metrics: SandboxMetrics) -> None:
        self.backend = backend
        self.spec = spec
        self.size = size
        self.metrics = metrics
        self._ready: deque[str] = deque()
        self._wakeup = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._fill_forever(), name="warm-pool-fill")

    def __len__(self) -> int:
        return len(self._ready)

    def take(self) -> str | None:
        """A started sandbox id, or None when the pool is empty; wakes the filler."""
        self._wakeup.set()
        while self._ready:
            sandbox_id = self._ready.popleft()
            self._update_gauge()
            if self.backend.is_alive(sandbox_id):
                return sandbox_id
            asyncio.get_running_loop().create_task(self.backend.destroy(sandbox_id))
        return None

    def _update_gauge(self) -> None:
        self.metrics.warm_pool_sandboxes.labels(self.backend.name).set(len(self._ready))

    async def _fill_forever(self) -> None:
        backoff_s = 0.5
        while True:
            while len(self._ready) < self.size:
                sandbox_id = new_sandbox_id()
                try:
                    await self.backend.create(sandbox_id, self.spec)
                except Exception as exc:  # a failing backend must not kill the pool; retry with backoff
                    log.warning("warm pool could not start a sandbox", extra={"error": str(exc)})
                    self.metrics.create_failures.labels(self.backend.name).inc()
                    await asyncio.sleep(backoff_s)
                    backoff_s = min(backoff_s * 2, MAX_BACKOFF_S)
                    continue
                backoff_s = 0.5
                self._ready.append(sandbox_id)
                self._update_gauge()
            self._wakeup.clear()
            await self._wakeup.wait()

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        while self._ready:
            await self.backend.destroy(self._ready.popleft())
        self._update_gauge()
