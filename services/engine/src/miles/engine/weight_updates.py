"""Weight updates on the scheduler thread: the served weight version and the updates waiting for their barrier.

A weight update waits for the sequences that arrived before it to finish (new ones queue behind it: its barrier is
the arrival order it took, and SeqPool.admit admits nothing that arrived later) unless generation is paused, then
it applies at once. Applying one swaps the runner's weights between two steps, flushes the prefix cache if asked
and relabels the served weight version if the update names one.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from miles.engine.metrics import EngineMetrics
from miles.engine.runner import Runner
from miles.engine.seq_pool import SeqPool

log = logging.getLogger(__name__)


@dataclass
class PendingUpdate:
    prepared: Any
    flush_cache: bool
    weight_version: str | None
    barrier: int
    source: str
    future: Future[str]


class WeightUpdates:
    """The served weight version and the pending updates, oldest first (used by the scheduler thread only)."""

    def __init__(self, runner: Runner, metrics: EngineMetrics | None, version: str) -> None:
        self._runner = runner
        self._metrics = metrics
        self.version = version
        self.pending: list[PendingUpdate] = []

    @property
    def barrier(self) -> int | None:
        """The oldest pending update's barrier (sequences that arrived after it wait), None if none is pending."""
        return self.pending[0].barrier if self.pending else None

    def take_due(self, pool: SeqPool, *, paused: bool) -> PendingUpdate | None:
        """The oldest pending update, taken off the list, if it may apply now: generation is paused, or every
        sequence that arrived before it has ended."""
        barrier = self.barrier
        if barrier is None:
            return None
        if paused or (not pool.running and all(s.arrival_order > barrier for s in pool.waiting)):
            return self.pending.pop(0)
        return None

    def apply(self, update: PendingUpdate, flush: Callable[[], None]) -> None:
        """Swap the runner's weights, call `flush` if the update asks for it, relabel; resolve the update's future
        with the served version, or with the runner's error if applying failed."""
        started = time.monotonic()
        try:
            self._runner.apply_weights(update.prepared)
        except Exception as exc:
            log.exception("applying weights failed", extra={"source": update.source})
            if self._metrics is not None:
                self._metrics.observe_weight_update(update.source, time.monotonic() - started, ok=False)
            update.future.set_exception(exc)
            return
        if update.flush_cache:
            flush()
        if update.weight_version is not None:
            self.version = update.weight_version
        if self._metrics is not None:
            self._metrics.observe_weight_update(update.source, time.monotonic() - started, ok=True)
        update.future.set_result(self.version)
