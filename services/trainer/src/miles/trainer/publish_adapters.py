"""`publish.kind: adapter`: a LoRA job on a shared engine pool publishes adapter versions, never weights.

Each version (the step's LoRA A/B tensors under PEFT's names, `TrainBackend.checkpoint_tensors`) goes:

1. to `<publish.dir>/adapter-v000007/` as a PEFT directory (`adapter_config.json` + `adapter_model.safetensors`)
   on a volume the pool's engines mount at the same path;
2. into every engine of the shared pool (`publish.pool` at the router) as `<job_id>@7` with SGLang's
   `/load_lora_adapter`, while the engines keep serving every job (miles.weightsync.adapters.PoolAdapters): an
   engine that does not take it fails the publish retryably, and the retry loads it again where it is missing;
3. live at the session server (`PUT /v1/jobs/{job_id}/adapter`): from then on the job's requests name `<job_id>@7`,
   and each turn records version 7 from the name it was served with, so staleness is the job's own;
4. then the job's versions older than the previous one are unloaded, freeing their adapter slots.

Between publishes, the live version is loaded again every `publish.adapter_reconcile_interval_s` wherever it is
missing (an engine that joined the pool or restarted holds no adapter): until then the job's requests that land on
such an engine fail (400), for at most that interval.

The base model is the pool's and stays frozen: it is never published. Version numbers follow the same ledger as
every publisher (miles.trainer.publish); a version's name stands for its bytes, so a version is never rewritten.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx

from miles.common.auth import bearer_headers
from miles.common.contracts.adapters import adapter_name
from miles.common.errors import ConfigError, UnavailableError
from miles.trainer.errors import PublishStateError
from miles.trainer.publish import WeightPublisher
from miles.trainer.publish_ledger import PublishLedger, VersionRecord, prune_version_dirs
from miles.weightsync.adapters import PoolAdapters, write_adapter_dir
from miles.weightsync.engine_client import RouterClient

if TYPE_CHECKING:
    import torch

    from miles.trainer.settings import TrainerSettings

log = logging.getLogger(__name__)
VERSION_PREFIX = "adapter-v"


class AdapterPublisher(WeightPublisher):
    pushes_directly = True
    ships_adapters = True

    def __init__(self, settings: TrainerSettings, ledger: PublishLedger) -> None:
        publish = settings.publish
        super().__init__(ledger, dtype=publish.dtype, retry_timeout_s=publish.retry_timeout_s)
        if settings.train.lora is None:
            raise ConfigError("publish.kind 'adapter' publishes a LoRA adapter: train.lora is needed", field="publish")
        if not publish.session_url:
            raise ConfigError("publish.kind 'adapter' needs publish.session_url", field="publish.session_url")
        from miles.trainer.backends.torch_lora import adapter_config_dict

        self.job_id = settings.job_id
        self.adapter_config: dict[str, Any] = adapter_config_dict(settings.train.lora, settings.model_path)
        router = (
            RouterClient(
                publish.router_url,
                publish.pool or settings.job_id,
                publish.engine_timeout_s,
                admin_token=settings.router_admin_token.get_secret_value(),
            )
            if publish.router_url
            else None
        )
        self.pool = PoolAdapters(
            settings.job_id,
            router,
            publish.engine_urls,
            timeout_s=publish.engine_timeout_s,
            engine_admin_api_key=settings.engine_admin_api_key.get_secret_value(),
            keep_loaded=publish.adapters_loaded,
        )
        self._router = router
        self.root = settings.resolved_publish_dir
        self.root.mkdir(parents=True, exist_ok=True)
        self.keep_last = max(publish.keep_last, publish.adapters_loaded)
        self.reconcile_interval_s = publish.adapter_reconcile_interval_s
        self._live: tuple[int, Path] | None = None
        self._reconciler: asyncio.Task[None] | None = None
        self._session = httpx.AsyncClient(
            base_url=publish.session_url.rstrip("/"),
            timeout=publish.engine_timeout_s,
            headers=bearer_headers(settings.session_operator_token.get_secret_value()),
        )

    def path_for(self, version: int) -> Path:
        return self.root / f"{VERSION_PREFIX}{version:06d}"

    async def _send(
        self, record: VersionRecord, tensors: dict[str, torch.Tensor], *, step_finished_unix_ms: int
    ) -> VersionRecord:
        path = self.path_for(record.version)
        await asyncio.to_thread(write_adapter_dir, path, tensors, self.adapter_config)
        failed = [load for load in await self.pool.roll(record.version, path) if load.failed]
        if failed:
            self._failures += len(failed)
            errors = "; ".join(f"{load.engine_url}: {load.error}" for load in failed)
            raise UnavailableError(f"adapter version {record.version} did not load on every engine: {errors}")
        await self._make_live(record.version)
        self._live = (record.version, path)
        if self._reconciler is None:
            self._reconciler = asyncio.create_task(self._reconcile_forever())
        await self.pool.retire(record.version)
        await asyncio.to_thread(self._retain, record.version)
        num_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
        return VersionRecord(**{**record.__dict__, "num_bytes": num_bytes})

    async def _make_live(self, version: int) -> None:
        body = {"lora_name": adapter_name(self.job_id, version), "weight_version": version}
        try:
            response = await self._session.put(f"/v1/jobs/{self.job_id}/adapter", json=body)
        except httpx.HTTPError as exc:
            raise UnavailableError(f"the session server could not be told adapter version {version}: {exc}") from exc
        if response.status_code >= 500:
            raise UnavailableError(f"the session server answered {response.status_code}: {response.text[:300]}")
        if response.status_code != 200:
            raise PublishStateError(
                f"the session server refused adapter version {version} of job {self.job_id} as live: "
                f"HTTP {response.status_code}: {response.text[:300]}"
            )

    def _retain(self, newest: int) -> None:
        prune_version_dirs(self.root, VERSION_PREFIX, newest=newest, keep_last=self.keep_last)

    async def reconcile(self) -> int:
        """Load the live version where it is missing; the number of engines that still do not hold it."""
        if self._live is None:
            return 0
        version, path = self._live
        failed = [load for load in await self.pool.roll(version, path) if load.failed]
        for load in failed:
            log.warning(
                "engine does not hold the live adapter",
                extra={"engine_url": load.engine_url, "weight_version": version, "error": load.error},
            )
        return len(failed)

    async def _reconcile_forever(self) -> None:
        while True:
            await asyncio.sleep(self.reconcile_interval_s)
            try:
                await self.reconcile()
            except Exception as exc:  # the router away for a moment: the next round tries again
                log.warning("adapter reconcile failed", extra={"error": str(exc)})

    async def close(self) -> None:
        """Stop reconciling and unload this job's versions from the pool: the trainer ends with the job (finished,
        cancelled), and a finished job's adapters would keep the pool's slots forever. A trainer that comes back
        (a crash, a rescheduled pod) loads its live version again at resume."""
        if self._reconciler is not None:
            self._reconciler.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reconciler
        try:
            unloaded = await self.pool.unload_all()
        except Exception as exc:  # best effort on the way out: the engines may be gone too
            log.warning("could not unload the job's adapters", extra={"error": str(exc)})
        else:
            log.info("unloaded the job's adapters", extra={"num_adapters": unloaded})
        await self.pool.close()
        if self._router is not None:
            await self._router.close()
        await self._session.aclose()
