"""Catching engines up: the origin's periodic check that every engine holds the latest stored version.

A rollout runs when a version is stored, but engines can still fall behind: one restarted (it starts from the
job's initial weights, version 0), joined in a resize, was unreachable during a rollout, or failed an update and
sits drained. Every `reconcile_interval_s`, when no rollout is running or queued, the origin reads each engine's
live version (its own and its peers') and updates the ones behind the latest version (or marked failed) with the
default transport and pause mode. An engine that cannot be reached (live version -1) or whose catch-up failed is
retried after a backoff that doubles up to `reconcile_max_backoff_s`, so a dead engine costs one attempt per
backoff, not one per interval.

Limits: engines are compared by version number; an engine that holds the latest number holds its weights (the
rollout protocol sets the label only after a verified load).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from miles.weightsync.engines import EngineOutcome

log = logging.getLogger(__name__)


@dataclass
class _Backoff:
    next_attempt_s: float = 0.0
    delay_s: float = 0.0


class Reconciler:
    """Decides which engines to catch up; the core supplies the status and runs the updates."""

    def __init__(self, *, initial_backoff_s: float, max_backoff_s: float) -> None:
        self.initial_backoff_s = initial_backoff_s
        self.max_backoff_s = max_backoff_s
        self._backoff: dict[str, _Backoff] = {}

    def behind(self, latest: int, engines: list[EngineOutcome], now_s: float) -> list[str]:
        """URLs of the engines to update now: behind `latest` or failed, and out of backoff."""
        due = []
        for engine in engines:
            if not engine.engine_url or latest < 0:
                continue
            lagging = engine.update_failed or engine.weight_version < latest
            if not lagging:
                self._backoff.pop(engine.engine_url, None)
                continue
            state = self._backoff.setdefault(engine.engine_url, _Backoff())
            if now_s >= state.next_attempt_s:
                due.append(engine.engine_url)
        return due

    def record(self, outcomes: list[EngineOutcome], now_s: float) -> None:
        """Back off the engines whose catch-up failed; forget the ones that made it."""
        for outcome in outcomes:
            if not outcome.engine_url:
                continue
            if outcome.update_failed or outcome.weight_version < 0:
                state = self._backoff.setdefault(outcome.engine_url, _Backoff())
                state.delay_s = min(max(state.delay_s * 2, self.initial_backoff_s), self.max_backoff_s)
                state.next_attempt_s = now_s + state.delay_s
            else:
                self._backoff.pop(outcome.engine_url, None)


async def reconcile_forever(
    interval_s: float,
    reconciler: Reconciler,
    *,
    idle: Callable[[], bool],
    status: Callable[[], Awaitable[tuple[int, list[EngineOutcome]]]],
    update: Callable[[int, list[str]], Awaitable[list[EngineOutcome]]],
) -> None:
    """Every interval_s while `idle()` (no rollout running or queued): update the engines that are behind."""
    while True:
        await asyncio.sleep(interval_s)
        if not idle():
            continue
        try:
            latest, engines = await status()
            due = reconciler.behind(latest, engines, time.monotonic())
            if not due or not idle():
                continue
            log.info("catching engines up", extra={"weight_version": latest, "engines": due})
            outcomes = await update(latest, due)
            reconciler.record(outcomes, time.monotonic())
        except Exception:  # the next pass tries again; a reconcile loop must not die
            log.exception("engine catch-up pass failed")
