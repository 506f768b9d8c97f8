"""The weight-sync core of one job: publish into the store, roll versions out, answer version queries, serve
versions to the other daemons. Plain asyncio; the gRPC layer (grpc_api.py) only translates messages.

Publishing (origin only): the header is checked against the store's latest version, chunks are assembled in
memory, the commit is verified (publish.py), and only then — under the store's write lock, with the parent
re-checked — the version is encoded (a snapshot every `snapshot_interval` versions, deltas against the parent in
between), its blobs and then its manifest are written, the head cache moves to it, retention runs, and (with
`auto_update`) a rollout of the newest version is scheduled. A daemon that has an `origin` refuses publishes.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from miles.common.errors import FailedPreconditionError
from miles.common.telemetry import Metrics
from miles.weightsync.daemon_client import DaemonClient
from miles.weightsync.datachannel import ChannelOffer, DataChannelServer
from miles.weightsync.engine_client import RouterClient
from miles.weightsync.engines import EngineOutcome, LocalEngines
from miles.weightsync.errors import DataChannelSetupError, UnknownJobError, WrongParentError
from miles.weightsync.events import STORED, EventLog, VersionEvent
from miles.weightsync.manifest import Manifest, TensorSpec
from miles.weightsync.metrics import WeightsyncMetrics
from miles.weightsync.provider import WeightProvider
from miles.weightsync.publish import PublishAssembler, PublishedVersion, check_header
from miles.weightsync.rollout import Peers, RolloutPlan, RolloutRunner
from miles.weightsync.settings import WeightsyncSettings
from miles.weightsync.store import VersionStore
from miles.weightsync.transports import TransportDeps, WeightTransport, make_transport
from miles.weightsync.weights import WeightSet, encode_version

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class VersionStatus:
    latest_version: int
    stored_versions: list[int]
    engines: list[EngineOutcome]


class WeightSyncCore:
    def __init__(self, settings: WeightsyncSettings, metrics: Metrics) -> None:
        self.settings = settings
        self.job_id = settings.job_id
        self.metrics = WeightsyncMetrics(metrics)
        self.store = VersionStore(settings.store_url or settings.store_dir, settings.job_id)
        self.origin = DaemonClient(settings.origin) if settings.origin else None
        self.provider = WeightProvider(
            self.store,
            origin=self.origin,
            metrics=self.metrics,
            fetch_streams=settings.fetch_streams,
            chunk_bytes=settings.chunk_bytes,
            retain_versions=settings.retain_versions,
            data_timeout_s=settings.data_timeout_s if settings.data_channel else None,
        )
        serves_data = settings.data_channel and self.origin is None
        self.data_server = (
            DataChannelServer(settings.host, settings.data_port, self.metrics, settings.data_timeout_s)
            if serves_data
            else None
        )
        self.events = EventLog(settings.event_history)
        timeout_s = settings.engine_request_timeout_s
        self.router = RouterClient(settings.router_url, settings.pool, timeout_s) if settings.router_url else None
        self.local = LocalEngines(
            settings.engine_urls,
            router=self.router,
            metrics=self.metrics,
            events=self.events,
            request_timeout_s=timeout_s,
        )
        self.peers = Peers(settings.peers, settings.peers_dns, settings.port)
        self.rollouts = RolloutRunner(self.job_id, self.local, self.peers, self.transport, self.events, self.metrics)
        self._transports: dict[str, WeightTransport] = {}
        self._wanted_version = -1
        self._rolled_version = -1
        self._auto_task: asyncio.Task[None] | None = None

    # --- lifecycle -----------------------------------------------------------------------------------------------
    async def start(self) -> None:
        versions = await asyncio.to_thread(self.store.list_versions)
        self.metrics.latest_version.set(versions[-1] if versions else -1)
        self.metrics.stored_versions.set(len(versions))
        if self.data_server is not None:
            self.data_server.start()

    async def close(self) -> None:
        if self._auto_task is not None:
            self._auto_task.cancel()
        if self.data_server is not None:
            await self.data_server.close()
        await self.local.close()
        await self.peers.close()
        if self.router is not None:
            await self.router.close()
        if self.origin is not None:
            await self.origin.close()

    def check_job(self, job_id: str) -> None:
        if job_id != self.job_id:
            raise UnknownJobError(job_id, self.job_id)

    def transport(self, name: str) -> WeightTransport:
        if name not in self._transports:
            deps = TransportDeps(
                provider=self.provider,
                metrics=self.metrics,
                work_dir=Path(self.settings.work_dir).resolve(),
                model_config_dir=Path(self.settings.model_config_dir) if self.settings.model_config_dir else None,
                tensor_batch_bytes=self.settings.tensor_batch_bytes,
            )
            self._transports[name] = make_transport(name, deps)
        return self._transports[name]

    # --- publish -------------------------------------------------------------------------------------------------
    async def begin_publish(
        self, job_id: str, version: int, parent_version: int, specs: Sequence[TensorSpec]
    ) -> PublishAssembler:
        """Check a publish header against the store; the assembler then takes the chunks."""
        self.check_job(job_id)
        if self.origin is not None:
            raise WrongParentError(f"publish to the origin daemon {self.settings.origin}, not to this one")
        latest = await self.provider.latest_version()
        parent_specs = None
        if latest >= 0:
            head = self.provider.head
            parent_specs = head.specs if head is not None and head.version == latest else None
            if parent_specs is None:
                parent_specs = (await asyncio.to_thread(self.store.get_manifest, latest)).specs
        check_header(
            version=version,
            parent_version=parent_version,
            specs=specs,
            latest_version=latest,
            parent_specs=parent_specs,
            max_bytes=self.settings.max_publish_bytes,
        )
        return PublishAssembler(job_id, version, parent_version, specs)

    async def store_published(self, published: PublishedVersion) -> Manifest:
        """Encode and write a checked version (the commit point is its manifest), then schedule its rollout."""
        async with self.provider.write_lock:
            latest = await asyncio.to_thread(self.store.latest_version)
            if published.parent_version != latest:
                raise WrongParentError(
                    f"parent_version {published.parent_version} is no longer the latest version {latest}",
                    field="header.parent_version",
                )
            manifest = await self._encode_and_write(published)
            self.provider.head = WeightSet(published.version, published.specs, published.data)
            retained = await asyncio.to_thread(self.store.apply_retention, self.settings.retain_versions)
        self._record_stored(manifest, retained.deleted_versions)
        await self.events.emit(
            VersionEvent(STORED, manifest.version, full_bytes=manifest.full_bytes, stored_bytes=manifest.stored_bytes)
        )
        if self.settings.auto_update:
            self._schedule_rollout(manifest.version)
        return manifest

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

    # --- rollouts ------------------------------------------------------------------------------------------------
    def _schedule_rollout(self, version: int) -> None:
        self._wanted_version = max(self._wanted_version, version)
        if self._auto_task is None or self._auto_task.done():
            self._auto_task = asyncio.create_task(self._auto_rollouts())

    async def _auto_rollouts(self) -> None:
        s = self.settings
        while self._rolled_version < self._wanted_version:
            version = self._wanted_version
            plan = RolloutPlan(version, s.transport, s.pause_mode, s.max_engines_updating, s.engine_timeout_s)
            try:
                await self.rollouts.run(plan)
            except Exception:  # a background rollout must not die silently; the next publish retries
                log.exception("automatic rollout failed", extra={"weight_version": version})
            self._rolled_version = version

    async def update_engines(self, plan: RolloutPlan) -> list[EngineOutcome]:
        if self.origin is None:  # the authoritative store must have it; other daemons fetch it while loading
            await self.provider.ensure_stored(plan.version)
        if self.local.urls:
            self.transport(plan.transport)  # refuse an unusable transport before touching any engine
        return await self.rollouts.run(plan)

    # --- queries -------------------------------------------------------------------------------------------------
    async def status(self) -> VersionStatus:
        versions = await asyncio.to_thread(self.store.list_versions)
        engines = await self.local.outcomes()
        peer_engines, unreachable = await self.peers.engines(self.job_id)
        engines += [outcome for _, outcome in peer_engines] + unreachable
        self.metrics.stored_versions.set(len(versions))
        return VersionStatus(versions[-1] if versions else -1, versions, engines)

    def watch(self, from_version: int) -> AsyncIterator[VersionEvent]:
        return self.events.watch(from_version)

    async def full_weights(self, version: int) -> WeightSet:
        return await self.provider.full(version)

    async def open_data_channel(self, version: int, num_connections: int) -> ChannelOffer:
        """A one-shot data channel offer for `version`'s full weights (the origin's fast path of FetchWeights)."""
        if self.data_server is None:
            raise FailedPreconditionError("the data channel is off on this daemon; use FetchWeights")
        weights = await self.full_weights(version)
        if not self.data_server.started:
            try:
                self.data_server.start()
            except DataChannelSetupError as exc:
                raise FailedPreconditionError(exc.message) from exc
        return self.data_server.offer(weights, num_connections)

    async def stored_blobs(self, version: int) -> tuple[Manifest, list[str]]:
        manifest = await self.provider.ensure_stored(version)
        return manifest, manifest.blob_sha256s()

    async def read_blob(self, sha256: str) -> bytes:
        return await asyncio.to_thread(self.store.get_blob, sha256)
