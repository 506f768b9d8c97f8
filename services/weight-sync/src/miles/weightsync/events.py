"""Version events of one daemon (stored, engine updated or failed, rollout complete) for WatchVersions.

A bounded in-memory log: watchers first get the remembered events with version >= from_version, then new ones
as they happen. Events are not persisted; a restarted daemon starts a new log (GetVersion tells the state).
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

STORED = "stored"
ENGINE_UPDATED = "engine_updated"
ENGINE_UPDATE_FAILED = "engine_update_failed"
ROLLOUT_COMPLETE = "rollout_complete"


@dataclass(frozen=True)
class VersionEvent:
    kind: str
    version: int
    engine_url: str = ""
    error: str = ""
    full_bytes: int = 0
    stored_bytes: int = 0
    fell_back: bool = False
    pause_s: float = 0.0
    transfer_s: float = 0.0
    wire_bytes: int = 0
    step_to_serving_s: float = 0.0
    weights_digest: str = ""
    at_unix_ms: int = field(default_factory=lambda: int(time.time() * 1000))


class EventLog:
    def __init__(self, max_events: int) -> None:
        self._events: deque[tuple[int, VersionEvent]] = deque(maxlen=max_events)
        self._next_seq = 0
        self._changed = asyncio.Condition()

    async def emit(self, event: VersionEvent) -> None:
        async with self._changed:
            self._events.append((self._next_seq, event))
            self._next_seq += 1
            self._changed.notify_all()

    def _has_events_from(self, seq: int) -> bool:
        return self._next_seq > seq

    async def watch(self, from_version: int) -> AsyncIterator[VersionEvent]:
        """Remembered events with version >= from_version, then every new one, until the caller stops."""
        next_seq = 0
        while True:
            async with self._changed:
                seen = next_seq
                await self._changed.wait_for(functools.partial(self._has_events_from, seen))
                pending = [(s, e) for s, e in self._events if s >= seen]
                next_seq = self._next_seq
            for _, event in pending:
                if event.version >= from_version:
                    yield event
