"""The trainer's event stream: per-step metrics and lifecycle events, kept in a bounded ring for replay and fanned
out to live watchers (the WatchEvents RPC, which the controller shows).

Kinds: `step` (metrics of one trainer step), `skipped` (a trainer step without signal: no version, its batch
statistics), `checkpoint` (a durable checkpoint and how many groups it acked), `state` (a state change),
`rejected` (a group nacked as untrainable, with its reason), `error`.
A slow watcher never blocks training: its queue is bounded and it loses the oldest events it has not read.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from miles.proto.trainer.v1 import trainer_pb2

_WATCHER_QUEUE = 1000


@dataclass(frozen=True)
class Event:
    kind: str
    step: int
    state: int = trainer_pb2.TRAINER_STATE_UNSPECIFIED
    metrics: dict[str, float] = field(default_factory=dict)
    message: str = ""
    at_unix_ms: int = field(default_factory=lambda: int(time.time() * 1000))

    def to_proto(self) -> trainer_pb2.TrainerEvent:
        return trainer_pb2.TrainerEvent(
            kind=self.kind,
            step=self.step,
            state=self.state,  # type: ignore[arg-type]
            metrics=self.metrics,
            message=self.message,
            at_unix_ms=self.at_unix_ms,
        )


class EventLog:
    """Bounded history plus live fan-out. Publish from the event loop's thread."""

    def __init__(self, keep: int) -> None:
        self._history: deque[Event] = deque(maxlen=keep)
        self._watchers: set[asyncio.Queue[Event]] = set()

    def publish(self, event: Event) -> None:
        self._history.append(event)
        for queue in self._watchers:
            if queue.full():
                queue.get_nowait()
            queue.put_nowait(event)

    def history(self, from_step: int = 0) -> list[Event]:
        return [event for event in self._history if event.step >= from_step]

    async def watch(self, from_step: int = 0) -> AsyncIterator[Event]:
        """Kept events with step >= from_step, then every new event, until the caller stops iterating."""
        queue: asyncio.Queue[Event] = asyncio.Queue(maxsize=_WATCHER_QUEUE)
        self._watchers.add(queue)
        try:
            for event in self.history(from_step):
                yield event
            while True:
                yield await queue.get()
        finally:
            self._watchers.discard(queue)
