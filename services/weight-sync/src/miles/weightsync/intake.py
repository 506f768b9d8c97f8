"""Taking publishes (origin only): header checks, idempotency, supersession, encoding and storing a version.

The header is checked against the store's latest version (publish.py's rules: no gaps, parent = latest, a
restarted trainer's rewind), and a version already stored with the same content is answered as such (publishing
is idempotent by version and content address; a number is never reused with other weights). The tensors are
assembled in memory — chunks of PublishWeights, or raw bytes over the data channel (publish_channel.py) — the
commit is verified, and only then, under the store's write lock with the parent re-checked, the version is
encoded (a snapshot every `snapshot_interval` versions, deltas against the parent in between), its blobs and then
its manifest are written, the head cache moves to it, retention runs, and `on_stored` is told (the core rolls it
out). A daemon that has an `origin` refuses publishes.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence

from miles.common.errors import NotFoundError
from miles.weightsync.datachannel import DataChannelServer
from miles.weightsync.errors import (
    DataChannelSetupError,
    InvalidPublishError,
    PublishChannelUnavailableError,
    UnknownJobError,
    VersionTakenError,
    WrongParentError,
)
from miles.weightsync.events import STORED, EventLog, VersionEvent
from miles.weightsync.manifest import Manifest, TensorSpec, manifest_digest
from miles.weightsync.metrics import WeightsyncMetrics
from miles.weightsync.provider import WeightProvider
from miles.weightsync.publish import PublishAssembler, PublishedVersion, PublishMeta, check_header
from miles.weightsync.publish_channel import PublishChannel, PublishOffer
from miles.weightsync.settings import WeightsyncSettings
from miles.weightsync.store import SupersededRange, VersionStore
from miles.weightsync.weights import WeightSet, encode_version

log = logging.getLogger(__name__)


def start_data_server(server: DataChannelServer) -> None:
    """Listen on first use when the core's start() did not (a core built without start(), as in tests)."""
    if not server.started:
        server.start()


class PublishIntake:
    """The publishing half of an origin daemon."""

    def __init__(
        self,
        settings: WeightsyncSettings,
        store: VersionStore,
        provider: WeightProvider,
        metrics: WeightsyncMetrics,
        events: EventLog,
        *,
        publish_channel: PublishChannel | None,
        data_server: DataChannelServer | None,
        on_stored: Callable[[int], None],
    ) -> None:
        self.settings = settings
        self.job_id = settings.job_id
        self.store = store
        self.provider = provider
        self.metrics = metrics
        self.events = events
        self.publish_channel = publish_channel
        self.data_server = data_server
        self.on_stored = on_stored

    def _check_job(self, job_id: str) -> None:
        if job_id != self.job_id:
            raise UnknownJobError(job_id, self.job_id)

    async def begin_publish(self, meta: PublishMeta, specs: Sequence[TensorSpec]) -> PublishAssembler | Manifest:
        """Check a publish header against the store: an assembler takes the chunks, or the stored manifest when
        this exact version is stored already (idempotent: nothing is to be stored)."""
        self._check_job(meta.job_id)
        if self.settings.origin:
            raise WrongParentError(f"publish to the origin daemon {self.settings.origin}, not to this one")
        latest = await self.provider.latest_version()
        stored = await self._stored_twin(meta, specs, latest)
        if stored is not None:
            return stored
        parent_specs = None
        if latest >= 0 and meta.parent_version == latest:
            head = self.provider.head
            parent_specs = head.specs if head is not None and head.version == latest else None
            if parent_specs is None:
                parent_specs = (await asyncio.to_thread(self.store.get_manifest, latest)).specs
        check_header(
            meta, specs, latest_version=latest, parent_specs=parent_specs, max_bytes=self.settings.max_publish_bytes
        )
        await self._check_restored(meta, specs)
        return PublishAssembler(meta, specs)

    async def _stored_twin(self, meta: PublishMeta, specs: Sequence[TensorSpec], latest: int) -> Manifest | None:
        """The stored manifest of meta.version when it has the same content; a stored version with other content
        is refused (numbers are never reused); None when meta.version is new."""
        if not 0 <= meta.version <= latest:
            return None
        if not await asyncio.to_thread(self.store.has_version, meta.version):
            raise VersionTakenError(
                f"version {meta.version} is older than the latest stored version {latest} (retention removed it): "
                f"publish the next version, {latest + 1}",
                field="header.version",
            )
        stored = await asyncio.to_thread(self.store.get_manifest, meta.version)
        if stored.manifest_sha256 != manifest_digest([spec.sha256 for spec in specs]):
            raise VersionTakenError(
                f"version {meta.version} is already stored with other weights (content address "
                f"{stored.manifest_sha256[:16]}...); version numbers are never reused: a trainer restored from an "
                f"older checkpoint publishes its weights as version {latest + 1} with restored_from_version",
                field="header.version",
            )
        return stored

    async def _check_restored(self, meta: PublishMeta, specs: Sequence[TensorSpec]) -> None:
        """A rewind must carry the weights of the version it restores when that version is still stored."""
        restored = meta.restored_from_version
        if restored is None or not await asyncio.to_thread(self.store.has_version, restored):
            return
        stored = await asyncio.to_thread(self.store.get_manifest, restored)
        if stored.manifest_sha256 != manifest_digest([spec.sha256 for spec in specs]):
            raise InvalidPublishError(
                f"the tensors are not the weights of version {restored} (content address "
                f"{stored.manifest_sha256[:16]}...), which the publish says it restores",
                field="header.restored_from_version",
            )

    async def store_published(self, published: PublishedVersion) -> Manifest:
        """Encode and write a checked version (the commit point is its manifest), then schedule its rollout."""
        async with self.provider.write_lock:
            latest = await asyncio.to_thread(self.store.latest_version)
            if published.parent_version != latest:
                raise WrongParentError(
                    f"parent_version {published.parent_version} is no longer the latest version {latest}",
                    field="header.parent_version",
                )
            restored = published.restored_from_version
            if restored is not None:
                entry = SupersededRange(restored + 1, published.version - 1, published.version)
                await asyncio.to_thread(self.store.add_superseded, entry)
            manifest = await self._encode_and_write(published)
            self.provider.head = WeightSet(published.version, published.specs, published.data)
            retained = await asyncio.to_thread(self.store.apply_retention, self.settings.retain_versions)
        self._record_stored(manifest, retained.deleted_versions)
        await self.events.emit(
            VersionEvent(
                STORED,
                manifest.version,
                full_bytes=manifest.full_bytes,
                stored_bytes=manifest.stored_bytes,
                weights_digest=manifest.weights_digest,
            )
        )
        self.on_stored(manifest.version)
        return manifest

    async def open_publish_channel(
        self, meta: PublishMeta, specs: Sequence[TensorSpec], num_connections: int
    ) -> PublishOffer | Manifest:
        """Check a publish header as begin_publish does, then offer a data channel for its tensors; the stored
        manifest when this exact version is stored already (nothing is to be sent)."""
        self._check_job(meta.job_id)
        if self.publish_channel is None and not self.settings.origin:
            raise PublishChannelUnavailableError("the data channel is off on this daemon; use PublishWeights")
        begun = await self.begin_publish(meta, specs)  # refuses daemons with an origin
        if isinstance(begun, Manifest):
            return begun
        assert self.publish_channel is not None and self.data_server is not None
        try:
            start_data_server(self.data_server)
        except DataChannelSetupError as exc:
            raise PublishChannelUnavailableError(exc.message) from exc
        return self.publish_channel.offer(begun, num_connections)

    async def commit_publish(self, publish_id: str, manifest_sha256: str) -> tuple[Manifest, bool]:
        """Store a publish whose tensors came over the data channel: (its manifest, already_stored)."""
        if self.publish_channel is None:
            raise NotFoundError(f"no pending publish {publish_id!r} (no data channel here)", field="publish_id")
        return await self.store_or_twin(await self.publish_channel.finish(publish_id, manifest_sha256))

    async def store_or_twin(self, published: PublishedVersion) -> tuple[Manifest, bool]:
        """store_published, idempotent by version and content address: when a concurrent publish of the same
        version and content was stored first, this one answers as already stored ((manifest, True)); other
        content is VersionTakenError."""
        try:
            return await self.store_published(published), False
        except WrongParentError:
            meta = PublishMeta(published.job_id, published.version, published.parent_version)
            twin = await self._stored_twin(meta, published.specs, await self.provider.latest_version())
            if twin is None:
                raise
        self.republished(twin)
        return twin, True

    def republished(self, manifest: Manifest) -> None:
        """An identical version was published again (a retry, a restarted trainer): count it and make sure the
        engines get it (its first rollout may have been cut short)."""
        self.metrics.publishes.labels("already_stored").inc()
        self.on_stored(manifest.version)

    async def _encode_and_write(self, published: PublishedVersion) -> Manifest:
        parent: WeightSet | None = None
        snapshot_version = published.version
        if published.parent_version >= 0:
            parent_manifest = await asyncio.to_thread(self.store.get_manifest, published.parent_version)
            if published.version - parent_manifest.snapshot_version < self.settings.snapshot_interval:
                snapshot_version = parent_manifest.snapshot_version
                head = self.provider.head
                parent = head if head is not None and head.version == published.parent_version else None
                parent = parent or await self.provider.materialize(published.parent_version)
        start_s = time.perf_counter()
        stored, blobs = await asyncio.to_thread(
            encode_version,
            published.specs,
            published.data,
            parent,
            snapshot=parent is None,
            level=self.settings.zstd_level,
        )
        self.metrics.observe_phase("encode", time.perf_counter() - start_s)
        manifest = Manifest(
            job_id=self.job_id,
            version=published.version,
            parent_version=published.parent_version,
            created_at_unix_ms=int(time.time() * 1000),
            is_snapshot=parent is None,
            snapshot_version=snapshot_version,
            tensors=tuple(stored),
            step_finished_unix_ms=published.step_finished_unix_ms,
            restored_from_version=published.restored_from_version,
        )
        start_s = time.perf_counter()
        for data in blobs.values():
            await asyncio.to_thread(self.store.put_blob, data)
        await asyncio.to_thread(self.store.put_manifest, manifest)
        self.metrics.observe_phase("store", time.perf_counter() - start_s)
        return manifest

    def _record_stored(self, manifest: Manifest, deleted_versions: Sequence[int]) -> None:
        m = self.metrics
        m.publishes.labels("stored").inc()
        m.publish_bytes.labels("full").inc(manifest.full_bytes)
        m.publish_bytes.labels("snapshot" if manifest.is_snapshot else "delta").inc(manifest.stored_bytes)
        if not manifest.is_snapshot and manifest.full_bytes:
            ratio = manifest.stored_bytes / manifest.full_bytes
            m.delta_ratio.set(ratio)
            m.delta_ratio_hist.observe(ratio)
            m.changed_elements_ratio.set(manifest.num_changed / max(1, manifest.num_elements))
        m.latest_version.set(manifest.version)
        log.info(
            "version stored",
            extra={
                "job_id": self.job_id,
                "weight_version": manifest.version,
                "is_snapshot": manifest.is_snapshot,
                "full_bytes": manifest.full_bytes,
                "stored_bytes": manifest.stored_bytes,
                "deleted_versions": list(deleted_versions),
            },
        )
