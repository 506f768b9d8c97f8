"""Where a daemon gets stored versions and full weights from.

- The origin (the daemon the trainer publishes to) holds the newest version's full weights in memory (`head`)
  and everything else in its store.
- A daemon next to engines reads the store it shares with the origin (a PVC or object storage opened at the same
  URL), or keeps its own store (e.g. an emptyDir) and copies each version it needs from the origin exactly as
  stored (`FetchStoredVersion`: compressed deltas, every blob checked against its content address) — so deltas,
  not full weights, cross the network. Full loads stream from the origin (`FetchWeights`).

Every WeightSet handed out has been checked tensor by tensor against the manifest's sha256.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import hashlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass

from miles.weightsync.daemon_client import DaemonClient
from miles.weightsync.errors import StoreCorruptError, VersionNotFoundError
from miles.weightsync.manifest import Manifest
from miles.weightsync.metrics import WeightsyncMetrics
from miles.weightsync.store import VersionStore
from miles.weightsync.weights import WeightSet, advance, materialize

log = logging.getLogger(__name__)


@dataclass
class ReceivedBytes:
    num_bytes: int = 0


_RECEIVED: contextvars.ContextVar[ReceivedBytes | None] = contextvars.ContextVar("received_bytes", default=None)


@contextlib.contextmanager
def counting_received() -> Iterator[ReceivedBytes]:
    """Counts the bytes this task (and what it awaits) receives from the origin inside the block."""
    counter = ReceivedBytes()
    token = _RECEIVED.set(counter)
    try:
        yield counter
    finally:
        _RECEIVED.reset(token)


def _count_received(num_bytes: int) -> None:
    counter = _RECEIVED.get()
    if counter is not None:
        counter.num_bytes += num_bytes


class WeightProvider:
    """Stored versions and full weights of one job, from the local store, the head cache or the origin."""

    def __init__(
        self,
        store: VersionStore,
        *,
        origin: DaemonClient | None,
        metrics: WeightsyncMetrics,
        fetch_streams: int,
        chunk_bytes: int,
        retain_versions: int,
        data_timeout_s: float | None = None,
    ) -> None:
        self.store = store
        self.job_id = store.job_id
        self.origin = origin
        self.metrics = metrics
        self.fetch_streams = fetch_streams
        self.chunk_bytes = chunk_bytes
        self.retain_versions = retain_versions
        self.data_timeout_s = data_timeout_s  # None: full loads use FetchWeights streams only
        self.head: WeightSet | None = None
        self.write_lock = asyncio.Lock()

    async def latest_version(self) -> int:
        return await asyncio.to_thread(self.store.latest_version)

    async def ensure_stored(self, version: int) -> Manifest:
        """The version's manifest, copying the version from the origin first when the local store lacks it."""
        if await asyncio.to_thread(self.store.has_version, version):
            return await asyncio.to_thread(self.store.get_manifest, version)
        if self.origin is None:
            raise VersionNotFoundError(f"version {version} is not in the store", field="version")
        async with self.write_lock:
            if not await asyncio.to_thread(self.store.has_version, version):
                await self._replicate(version)
        return await asyncio.to_thread(self.store.get_manifest, version)

    async def _replicate(self, version: int) -> None:
        assert self.origin is not None
        manifest: Manifest | None = None
        buffers: dict[str, bytearray] = {}
        num_bytes = 0
        async for message in self.origin.fetch_stored(self.job_id, version, self.chunk_bytes):
            if message.WhichOneof("payload") == "manifest_json":
                manifest = Manifest.from_json(message.manifest_json)
                continue
            blob = message.blob
            buffer = buffers.setdefault(blob.sha256, bytearray())
            if blob.offset != len(buffer):
                raise StoreCorruptError(f"blob {blob.sha256} arrived out of order from the origin")
            buffer += blob.data
            num_bytes += len(blob.data)
        if manifest is None or manifest.version != version or manifest.job_id != self.job_id:
            raise StoreCorruptError(f"the origin sent no manifest for version {version}")
        for sha256 in manifest.blob_sha256s():
            data = bytes(buffers.get(sha256, b""))
            if hashlib.sha256(data).hexdigest() != sha256:
                raise StoreCorruptError(f"blob {sha256} of version {version} arrived corrupt or incomplete")
            await asyncio.to_thread(self.store.put_blob, data)
        await asyncio.to_thread(self.store.put_manifest, manifest)
        await asyncio.to_thread(self.store.apply_retention, self.retain_versions)
        self.metrics.replicated_bytes.inc(num_bytes)
        _count_received(num_bytes)
        log.info("version replicated from the origin", extra={"weight_version": version, "num_bytes": num_bytes})

    async def advance(self, weights: WeightSet, version: int) -> WeightSet:
        """`weights` moved to `version` through stored deltas (copied from the origin as needed), verified."""
        for between in range(weights.version + 1, version + 1):
            await self.ensure_stored(between)
        return await asyncio.to_thread(advance, self.store, weights, version)

    async def materialize(self, version: int) -> WeightSet:
        manifest = await self.ensure_stored(version)
        for between in range(manifest.snapshot_version, version):
            await self.ensure_stored(between)
        return await asyncio.to_thread(materialize, self.store, version)

    async def full(self, version: int) -> WeightSet:
        """Full weights of `version`: the head cache, else streamed from the origin, else rebuilt from the store."""
        if self.head is not None and self.head.version == version:
            return self.head
        if self.origin is not None:
            return await self.stream_full(version)
        return await self.materialize(version)

    async def stream_full(self, version: int) -> WeightSet:
        """Full weights from the origin (its data channel, else FetchWeights streams); the head cache on the
        origin itself."""
        if self.origin is None:
            return await self.full(version)
        published, path = await self.origin.fetch_full(
            self.job_id,
            version,
            num_connections=self.fetch_streams,
            chunk_bytes=self.chunk_bytes,
            data_timeout_s=self.data_timeout_s,
        )
        self.metrics.fetches.labels(path).inc()
        num_bytes = sum(spec.num_bytes for spec in published.specs)
        self.metrics.fetched_bytes.inc(num_bytes)
        _count_received(num_bytes)
        return WeightSet(published.version, published.specs, published.data)
