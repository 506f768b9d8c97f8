"""The loop's publishing of its weight versions: which tensors a version is (the adapter's or the HF weights), the
resume at start-up and the rewind it may announce, and the metrics and events of every publish.

How a version travels, is retried and is recorded is the `WeightPublisher`'s (publish.py); the trainer keeps the
version number (`Trainer.weight_version`), this only reports the one it must continue from.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from miles.trainer.events import Event, EventLog
from miles.trainer.metrics import TrainerMetrics

if TYPE_CHECKING:
    from miles.trainer.distributed import RankRunner
    from miles.trainer.publish import WeightPublisher
    from miles.trainer.publish_ledger import VersionRecord


class VersionPublishing:
    """Rank 0's publishes; `compute` runs a runner operation on the loop's compute thread."""

    def __init__(
        self,
        publisher: WeightPublisher,
        runner: RankRunner,
        compute: Callable[..., Awaitable[Any]],
        metrics: TrainerMetrics,
        events: EventLog,
    ) -> None:
        self.publisher, self.runner, self._compute = publisher, runner, compute
        self.metrics, self.events = metrics, events

    async def resume(self, weight_version: int, *, step: int) -> int:
        """Publish the weights the trainer starts from, as `weight_version`; returns the version it continues from
        (another one after a rewind: versions a dead predecessor published above it are superseded)."""
        tensors = await self._compute(self._source())
        record = await self.publisher.resume(weight_version, tensors, step=step)
        if record.version != weight_version:
            self.events.publish(
                Event(
                    "rewind",
                    step,
                    message=f"restored version {weight_version} published as {record.version}; versions "
                    f"{weight_version + 1}..{record.version - 1} of a dead trainer are superseded",
                )
            )
        self._published(record, step)
        return record.version

    async def publish(self, weight_version: int, *, step: int, step_finished_unix_ms: int) -> float:
        """Publish the version a step produced; returns the seconds it took (gathering the tensors included)."""
        started = time.perf_counter()
        tensors = await self._compute(self._source())
        record = await self.publisher.publish(
            weight_version, tensors, step=step, step_finished_unix_ms=step_finished_unix_ms
        )
        publish_s = time.perf_counter() - started
        self.metrics.phase_seconds.labels("publish").observe(publish_s)
        self._published(record, step)
        return publish_s

    def _source(self) -> Callable[[], dict[str, Any]]:
        """The adapter's tensors for a publisher of adapter versions, else the HF weights the engines serve."""
        return self.runner.adapter_tensors if self.publisher.ships_adapters else self.runner.hf_tensors

    def _published(self, record: VersionRecord, step: int) -> None:
        self.metrics.published_version.set(record.version)
        failures = self.publisher.take_failures()
        if failures:
            self.metrics.publish_failures.inc(failures)
        if record.weights_digest:
            self.events.publish(
                Event(
                    "published",
                    step,
                    metrics={"weight_version": record.version, "num_bytes": record.num_bytes},
                    message=record.weights_digest,
                )
            )
