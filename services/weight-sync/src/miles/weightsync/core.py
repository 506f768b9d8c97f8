"""The weight-sync core of one job: roll versions out, answer version queries, serve versions to the other
daemons, and (on the origin) take publishes through `intake` (intake.py). Plain asyncio; the gRPC layer
(grpc_api.py) only translates messages.

With `auto_update`, every version stored (or published again) is rolled out to the engines, newest first when
they queue up, and the origin's reconcile loop (reconcile.py) catches up engines left behind.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from miles.common.errors import FailedPreconditionError
from miles.common.telemetry import Metrics
from miles.common.weights import weights_digest
from miles.weightsync.daemon_client import DaemonClient
from miles.weightsync.datachannel import ChannelOffer, DataChannelServer
from miles.weightsync.engine_client import RouterClient
from miles.weightsync.engines import EngineOutcome, LocalEngines
from miles.weightsync.errors import (
    DataChannelSetupError,
    UnknownJobError,
)
from miles.weightsync.events import EventLog, VersionEvent
from miles.weightsync.intake import PublishIntake, start_data_server
from miles.weightsync.manifest import Manifest
from miles.weightsync.metrics import WeightsyncMetrics
from miles.weightsync.provider import WeightProvider
from miles.weightsync.publish_channel import PublishChannel
from miles.weightsync.reconcile import Reconciler, reconcile_forever
from miles.weightsync.rollout import Peers, RolloutPlan, RolloutRunner
from miles.weightsync.settings import WeightsyncSettings
from miles.weightsync.store import SupersededRange, VersionStore
from miles.weightsync.transports import TransportDeps, WeightTransport, make_transport
from miles.weightsync.weights import WeightSet

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class VersionStatus:
    latest_version: int
    stored_versions: list[int]
    engines: list[EngineOutcome]
    superseded: list[SupersededRange]
    latest_weights_digest: str


def _router_client(settings: WeightsyncSettings) -> RouterClient | None:
    if not settings.router_url:
        return None
    admin_token = settings.router_admin_token.get_secret_value()
    return RouterClient(settings.router_url, settings.pool, settings.control_timeout_s, admin_token=admin_token)


class WeightSyncCore:
    def __init__(self, settings: WeightsyncSettings, metrics: Metrics) -> None:
        self.settings = settings
        self.job_id = settings.job_id
        self.metrics = WeightsyncMetrics(metrics)
        self.store = VersionStore(settings.store_url or settings.store_dir, settings.job_id)
        auth_token = settings.auth_token.get_secret_value()  # the job's daemons share it: sent to origin and peers
        self.origin = DaemonClient(settings.origin, auth_token=auth_token) if settings.origin else None
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
        self.publish_channel = PublishChannel(self.data_server, self.metrics) if self.data_server is not None else None
        self.events = EventLog(settings.event_history)
        self.router = _router_client(settings)
        self.local = LocalEngines(
            settings.engine_urls,
            router=self.router,
            metrics=self.metrics,
            events=self.events,
            request_timeout_s=settings.engine_request_timeout_s,
            engine_admin_api_key=settings.engine_admin_api_key.get_secret_value(),
            engine_api_key=settings.engine_api_key.get_secret_value(),
            drain_timeout_s=settings.drain_timeout_s,
            control_timeout_s=settings.control_timeout_s,
        )
        self.peers = Peers(
            settings.peers, settings.peers_dns, settings.port, auth_token=auth_token, timeout_s=settings.peer_timeout_s
        )
        self.rollouts = RolloutRunner(self.job_id, self.local, self.peers, self.transport, self.events, self.metrics)
        self.intake = PublishIntake(
            settings,
            self.store,
            self.provider,
            self.metrics,
            self.events,
            publish_channel=self.publish_channel,
            data_server=self.data_server,
            on_stored=self._on_stored,
        )
        self._transports: dict[str, WeightTransport] = {}
        self._wanted_version = -1
        self._rolled_version = -1
        self._auto_task: asyncio.Task[None] | None = None
        self._reconcile_task: asyncio.Task[None] | None = None

    # --- lifecycle -----------------------------------------------------------------------------------------------
    async def start(self) -> None:
        versions = await asyncio.to_thread(self.store.list_versions)
        self.metrics.latest_version.set(versions[-1] if versions else -1)
        self.metrics.stored_versions.set(len(versions))
        if self.data_server is not None:
            self.data_server.start()
        s = self.settings
        if self.origin is None and s.auto_update and s.reconcile_interval_s > 0:
            reconciler = Reconciler(initial_backoff_s=s.reconcile_interval_s, max_backoff_s=s.reconcile_max_backoff_s)
            self._reconcile_task = asyncio.create_task(
                reconcile_forever(
                    s.reconcile_interval_s,
                    reconciler,
                    idle=self._rollouts_idle,
                    status=self._engine_versions,
                    update=self._catch_up,
                )
            )

    async def close(self) -> None:
        if self._reconcile_task is not None:
            self._reconcile_task.cancel()
        if self._auto_task is not None:
            self._auto_task.cancel()
        if self.publish_channel is not None:
            self.publish_channel.close()
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

    # --- rollouts ------------------------------------------------------------------------------------------------
    def _on_stored(self, version: int) -> None:
        """A version was stored or published again: with auto_update, roll it out (the newest wins)."""
        if self.settings.auto_update:
            self._schedule_rollout(version)

    def _schedule_rollout(self, version: int) -> None:
        self._wanted_version = max(self._wanted_version, version)
        if self._auto_task is None or self._auto_task.done():
            self._auto_task = asyncio.create_task(self._auto_rollouts())

    async def _auto_rollouts(self) -> None:
        while self._rolled_version < self._wanted_version:
            version = self._wanted_version
            try:
                await self.rollouts.run(await self._default_plan(version))
            except Exception:  # a background rollout must not die silently; the reconcile loop catches up
                log.exception("automatic rollout failed", extra={"weight_version": version})
            self._rolled_version = version

    async def _default_plan(self, version: int, engine_urls: Sequence[str] = ()) -> RolloutPlan:
        s = self.settings
        manifest = await asyncio.to_thread(self.store.get_manifest, version)
        return RolloutPlan(
            version,
            s.transport,
            s.pause_mode,
            s.max_engines_updating,
            s.engine_timeout_s,
            engine_urls=tuple(engine_urls),
            step_finished_unix_ms=manifest.step_finished_unix_ms,
        )

    def _rollouts_idle(self) -> bool:
        return not self.rollouts.lock.locked() and self._rolled_version >= self._wanted_version

    async def _engine_versions(self) -> tuple[int, list[EngineOutcome]]:
        status = await self.status()
        return status.latest_version, status.engines

    async def _catch_up(self, version: int, engine_urls: list[str]) -> list[EngineOutcome]:
        return await self.rollouts.run(await self._default_plan(version, engine_urls))

    async def update_engines(self, plan: RolloutPlan) -> list[EngineOutcome]:
        if self.origin is None:  # the authoritative store must have it; other daemons fetch it while loading
            manifest = await self.provider.ensure_stored(plan.version)
            if not plan.step_finished_unix_ms:
                plan = dataclasses.replace(plan, step_finished_unix_ms=manifest.step_finished_unix_ms)
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
        latest = versions[-1] if versions else -1
        superseded = await asyncio.to_thread(self.store.superseded)
        return VersionStatus(latest, versions, engines, superseded, await self._digest_of(latest))

    async def _digest_of(self, version: int) -> str:
        if version < 0:
            return ""
        head = self.provider.head
        specs = head.specs if head is not None and head.version == version else None
        if specs is None:
            specs = (await asyncio.to_thread(self.store.get_manifest, version)).specs
        return weights_digest({spec.name: spec.sha256 for spec in specs})

    def watch(self, from_version: int) -> AsyncIterator[VersionEvent]:
        return self.events.watch(from_version)

    async def full_weights(self, version: int) -> WeightSet:
        return await self.provider.full(version)

    async def open_data_channel(self, version: int, num_connections: int) -> ChannelOffer:
        """A one-shot data channel offer for `version`'s full weights (the origin's fast path of FetchWeights)."""
        if self.data_server is None:
            raise FailedPreconditionError("the data channel is off on this daemon; use FetchWeights")
        weights = await self.full_weights(version)
        try:
            start_data_server(self.data_server)
        except DataChannelSetupError as exc:
            raise FailedPreconditionError(exc.message) from exc
        return self.data_server.offer(weights, num_connections)

    async def stored_blobs(self, version: int) -> tuple[Manifest, list[str]]:
        manifest = await self.provider.ensure_stored(version)
        return manifest, manifest.blob_sha256s()

    async def read_blob(self, sha256: str) -> bytes:
        return await asyncio.to_thread(self.store.get_blob, sha256)
