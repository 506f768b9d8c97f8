"""Publishers that drive the job's engines themselves: `nccl` and `disk`.

The engines are the job's router pool (`publish.router_url`, pool = the job id: engines that join in a resize
are found at the next publish) plus any static `publish.engine_urls`. Each version is rolled through them with
weight-sync's version-locked engine lifecycle (`miles.weightsync.engines.LocalEngines`, at most
`max_engines_updating` at once): quiesce (`drain` at the router, or `/pause_generation` retract/in_place/abort)
-> load -> `/update_weight_version` + read it back -> resume. An engine that fails is left drained and paused,
counted, and gets the next version (the nccl and disk loads are always full, so nothing else is needed).

- `nccl`: `miles.weightsync.nccl.NcclTransport` — one weight-update group per engine (the trainer is rank 0),
  created on the engine's first load (`/init_weights_update_group`), then per version
  `/update_weights_from_distributed` per bucket while the trainer broadcasts (NCCL on GPUs, gloo on the CPU; the
  CPU engine implements both endpoints). A failed load forgets that engine's group; the next one creates it anew.
  NCCL moves GPU memory only: over an `nccl` group each tensor of the (CPU) snapshot is copied to this rank's
  current GPU just before its broadcast, one at a time; over `gloo` the CPU tensors go as they are.
- `disk`: the version as an HF directory `<publish.dir>/weights-v000007/` written atomically on a volume the
  engines mount at the same path, then `/update_weights_from_disk`.

Router admin calls carry `router_admin_token`, engine requests `engine_admin_api_key`, the engines' version reads
`engine_api_key` when set (trainer settings; see miles.weightsync.engine_client).

Every version pushed is first recorded as an intent in the publish ledger, so that a restarted trainer never
reuses a number that may have reached an engine.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

from miles.common.errors import ConfigError
from miles.trainer.checkpoint import TEMP_PREFIX, atomic_publish_dir, write_hf_dir
from miles.trainer.publish import WeightPublisher
from miles.trainer.publish_ledger import PublishLedger, VersionRecord, prune_version_dirs
from miles.weightsync.engine_client import EngineClient
from miles.weightsync.transports import LoadResult, PreparedLoad, WeightTransport
from miles.weightsync.weights import WeightSet

if TYPE_CHECKING:
    import torch

    from miles.common.telemetry import Metrics
    from miles.trainer.settings import PublishSettings, TrainerSettings
    from miles.weightsync.engines import EngineOutcome, LocalEngines

log = logging.getLogger(__name__)
VERSION_PREFIX = "weights-v"


class EngineFleet:
    """The job's engines as the trainer sees them: discovered at each publish, updated version-locked."""

    def __init__(
        self,
        publish: PublishSettings,
        job_id: str,
        metrics: Metrics | None,
        *,
        router_admin_token: str = "",
        engine_admin_api_key: str = "",
        engine_api_key: str = "",
    ) -> None:
        """The tokens go with every router admin call and every engine request, `engine_api_key` with the engines'
        version reads ("" = that side is open)."""
        from miles.common.telemetry import Metrics
        from miles.weightsync.engine_client import RouterClient
        from miles.weightsync.events import EventLog
        from miles.weightsync.metrics import WeightsyncMetrics

        self.settings = publish
        pool = publish.pool or job_id
        timeout_s = publish.engine_timeout_s
        self.router = (
            RouterClient(publish.router_url, pool, timeout_s, admin_token=router_admin_token)
            if publish.router_url
            else None
        )
        self.engine_admin_api_key = engine_admin_api_key
        self.engine_api_key = engine_api_key
        self.static_urls = [url.rstrip("/") for url in publish.engine_urls]
        self.metrics = WeightsyncMetrics(metrics if metrics is not None else Metrics("trainer"))
        self.events = EventLog(100)
        self._engines: dict[str, LocalEngines] = {}

    async def discover(self) -> list[str]:
        urls = list(self.static_urls)
        if self.router is not None:
            urls += [str(engine["url"]).rstrip("/") for engine in await self.router.list_engines()]
        return list(dict.fromkeys(urls))

    async def update(
        self, version: int, transport: WeightTransport, *, step_finished_unix_ms: int
    ) -> list[EngineOutcome]:
        from miles.weightsync.engines import LocalEngines

        urls = await self.discover()
        for url in [u for u in self._engines if u not in urls]:
            await self._engines.pop(url).close()
        for url in urls:
            if url not in self._engines:
                self._engines[url] = LocalEngines(
                    [url],
                    router=self.router,
                    metrics=self.metrics,
                    events=self.events,
                    request_timeout_s=self.settings.engine_timeout_s,
                    engine_admin_api_key=self.engine_admin_api_key,
                    engine_api_key=self.engine_api_key,
                )
        slots = asyncio.Semaphore(self.settings.max_engines_updating)
        pause_mode = self.settings.pause_mode if self.router is not None else "retract"

        async def one(url: str) -> EngineOutcome:
            async with slots:
                return await self._engines[url].update(
                    url,
                    version,
                    transport,
                    pause_mode,
                    self.settings.engine_timeout_s,
                    step_finished_unix_ms=step_finished_unix_ms,
                )

        return list(await asyncio.gather(*(one(url) for url in urls)))

    async def close(self) -> None:
        for engines in self._engines.values():
            await engines.close()
        if self.router is not None:
            await self.router.close()


class _EnginePublisher(WeightPublisher):
    pushes_directly = True

    def __init__(self, settings: TrainerSettings, ledger: PublishLedger, metrics: Metrics | None) -> None:
        publish = settings.publish
        super().__init__(ledger, dtype=publish.dtype, retry_timeout_s=publish.retry_timeout_s)
        self.fleet = EngineFleet(
            publish,
            settings.job_id,
            metrics,
            router_admin_token=settings.router_admin_token.get_secret_value(),
            engine_admin_api_key=settings.engine_admin_api_key.get_secret_value(),
            engine_api_key=settings.engine_api_key.get_secret_value(),
        )

    async def _roll(self, record: VersionRecord, transport: WeightTransport, step_finished_unix_ms: int) -> None:
        outcomes = await self.fleet.update(record.version, transport, step_finished_unix_ms=step_finished_unix_ms)
        failed = [outcome for outcome in outcomes if outcome.update_failed]
        self._failures += len(failed)
        for outcome in failed:
            log.warning(
                "engine did not take the version",
                extra={"engine_url": outcome.engine_url, "weight_version": record.version, "error": outcome.error},
            )

    async def close(self) -> None:
        await self.fleet.close()


class NcclPublisher(_EnginePublisher):
    def __init__(self, settings: TrainerSettings, ledger: PublishLedger, metrics: Metrics | None) -> None:
        super().__init__(settings, ledger, metrics)
        from miles.weightsync.nccl import NcclConfig
        from miles.weightsync.transports import TransportDeps, make_transport

        publish = settings.publish
        backend = publish.resolved_nccl_backend
        config = NcclConfig(
            master_address=publish.nccl_master_address or settings.master_addr,
            master_port=publish.nccl_master_port,
            backend=backend,
            bucket_bytes=publish.nccl_bucket_bytes,
            timeout_s=publish.engine_timeout_s,
            device=broadcast_device(backend),
        )
        self._tensors: dict[str, Any] = {}
        self.transport = make_transport(
            "nccl", TransportDeps(nccl_config=config, nccl_weights=lambda version: self._tensors)
        )

    async def _send(
        self, record: VersionRecord, tensors: dict[str, torch.Tensor], *, step_finished_unix_ms: int
    ) -> VersionRecord:
        self._tensors = tensors
        try:
            await self._roll(record, self.transport, step_finished_unix_ms)
        finally:
            self._tensors = {}
        num_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
        return VersionRecord(**{**record.__dict__, "num_bytes": num_bytes})

    async def close(self) -> None:
        close = getattr(self.transport, "close", None)
        if close is not None:
            await close()
        await super().close()


def broadcast_device(backend: str) -> str:
    """Where the update groups' tensors must be when broadcast: this rank's current GPU for nccl (chosen at start,
    after distributed.py bound the rank to its GPU), "" (where they are: the CPU) for gloo."""
    if backend != "nccl":
        return ""
    import torch

    if not torch.cuda.is_available():
        raise ConfigError(
            "publish.nccl_backend 'nccl' needs CUDA on the trainer (NCCL broadcasts GPU memory): use 'gloo' or 'auto'",
            field="publish.nccl_backend",
        )
    return f"cuda:{torch.cuda.current_device()}"


class DiskPublisher(_EnginePublisher):
    def __init__(self, settings: TrainerSettings, ledger: PublishLedger, metrics: Metrics | None) -> None:
        super().__init__(settings, ledger, metrics)
        self.root = settings.resolved_publish_dir
        self.root.mkdir(parents=True, exist_ok=True)
        self.source_model_dir = settings.model_path
        self.keep_last = settings.publish.keep_last

    def path_for(self, version: int) -> Path:
        return self.root / f"{VERSION_PREFIX}{version:06d}"

    async def _send(
        self, record: VersionRecord, tensors: dict[str, torch.Tensor], *, step_finished_unix_ms: int
    ) -> VersionRecord:
        path = await asyncio.to_thread(self._write, record.version, tensors)
        await self._roll(record, _DiskPathTransport(path), step_finished_unix_ms)
        num_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
        return VersionRecord(**{**record.__dict__, "num_bytes": num_bytes})

    def _write(self, version: int, tensors: dict[str, torch.Tensor]) -> Path:
        final = self.path_for(version)
        temp = self.root / f"{TEMP_PREFIX}{final.name}-{uuid.uuid4().hex[:8]}"
        dtype = next(iter(tensors.values())).dtype if tensors else None
        if dtype is None:
            raise ValueError("nothing to publish")
        write_hf_dir(temp, tensors, self.source_model_dir, dtype=dtype)
        atomic_publish_dir(temp, final)
        self._retain(version)
        return final

    def _retain(self, newest: int) -> None:
        prune_version_dirs(self.root, VERSION_PREFIX, newest=newest, keep_last=self.keep_last)


class _DiskPathTransport(WeightTransport):
    """Loads an already written HF directory with /update_weights_from_disk."""

    name = "disk"

    def __init__(self, path: Path) -> None:
        self.path = path

    async def prepare(self, engine_url: str, version: int, current: WeightSet | None) -> PreparedLoad:
        return PreparedLoad(version, None, "full", model_path=str(self.path))

    async def apply(self, engine: EngineClient, prepared: PreparedLoad) -> LoadResult:
        await engine.update_weights_from_disk(prepared.model_path, str(prepared.version))
        return LoadResult(None, "full", 0)
