"""Publishing new weights to inference: a small interface, chosen by `make_publisher`.

Until weight-sync (issue 11) provides its transport, the `disk` publisher writes each version as an HF
safetensors directory `<dir>/weights-v000007/` (atomically: temp dir, fsync, rename) and, when engine URLs are
configured, asks each engine to load it with SGLang's `POST /update_weights_from_disk {"model_path",
"weight_version"}`. An engine that fails to load is logged and counted, never fatal to training: engines are
weight-sync's to heal; the trainer's duty is that the version exists durably.

Limit: after a crash the trainer restarts from its last checkpoint and republishes that version; versions
published after it by the crashed process are overwritten when training reaches them again.
"""

from __future__ import annotations

import abc
import asyncio
import logging
import shutil
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import torch

from miles.trainer.checkpoint import TEMP_PREFIX, atomic_publish_dir, write_hf_dir
from miles.trainer.settings import PublishSettings, TrainerSettings

log = logging.getLogger(__name__)
VERSION_PREFIX = "weights-v"


@dataclass
class PublishResult:
    """Where the version went and which engines did not take it."""

    version: int
    location: str
    failed_engines: list[str] = field(default_factory=list)


class WeightPublisher(abc.ABC):
    """Makes a weight version available to inference."""

    @abc.abstractmethod
    async def publish(self, version: int, tensors: dict[str, torch.Tensor]) -> PublishResult:
        """Publish `tensors` (HF names, full weights) as `version`."""

    async def close(self) -> None:
        return None


class NullPublisher(WeightPublisher):
    """Publishes nothing (SFT jobs, tests)."""

    async def publish(self, version: int, tensors: dict[str, torch.Tensor]) -> PublishResult:
        return PublishResult(version=version, location="")


class DiskPublisher(WeightPublisher):
    """An HF directory per version under `root`, then /update_weights_from_disk on each engine."""

    def __init__(self, root: Path, config: PublishSettings, *, source_model_dir: Path | None) -> None:
        self.root = root
        self.config = config
        self.source_model_dir = source_model_dir
        self.root.mkdir(parents=True, exist_ok=True)
        self._http = httpx.AsyncClient(timeout=config.engine_timeout_s)

    def path_for(self, version: int) -> Path:
        return self.root / f"{VERSION_PREFIX}{version:06d}"

    def _write(self, version: int, tensors: dict[str, torch.Tensor]) -> Path:
        final = self.path_for(version)
        temp = self.root / f"{TEMP_PREFIX}{final.name}-{uuid.uuid4().hex[:8]}"
        write_hf_dir(temp, tensors, self.source_model_dir)
        atomic_publish_dir(temp, final)
        self._retain(version)
        return final

    def _retain(self, newest: int) -> None:
        versions = []
        for path in self.root.glob(f"{VERSION_PREFIX}*"):
            suffix = path.name.removeprefix(VERSION_PREFIX)
            if suffix.isdigit():
                versions.append(int(suffix))
        # Versions above the newest are leftovers of a crashed run: they would shadow the real ones.
        stale = [v for v in versions if v > newest] + sorted(v for v in versions if v <= newest)[
            : -self.config.keep_last
        ]
        for version in stale:
            shutil.rmtree(self.path_for(version), ignore_errors=True)

    async def publish(self, version: int, tensors: dict[str, torch.Tensor]) -> PublishResult:
        path = await asyncio.to_thread(self._write, version, tensors)
        failed = []
        for url in self.config.engine_urls:
            if not await self._update_engine(url, path, version):
                failed.append(url)
        return PublishResult(version=version, location=str(path), failed_engines=failed)

    async def _update_engine(self, url: str, path: Path, version: int) -> bool:
        body = {"model_path": str(path), "weight_version": str(version)}
        try:
            response = await self._http.post(f"{url.rstrip('/')}/update_weights_from_disk", json=body)
        except httpx.HTTPError as exc:
            log.warning("engine weight update failed", extra={"engine": url, "version": version, "error": str(exc)})
            return False
        if response.status_code != 200 or not response.json().get("success", False):
            log.warning(
                "engine refused weight update",
                extra={"engine": url, "version": version, "status": response.status_code, "body": response.text[:300]},
            )
            return False
        return True

    async def close(self) -> None:
        await self._http.aclose()


def make_publisher(settings: TrainerSettings) -> WeightPublisher:
    """The publisher named by settings.publish.kind."""
    if settings.publish.kind == "none":
        return NullPublisher()
    if settings.publish.kind == "disk":
        return DiskPublisher(settings.resolved_publish_dir, settings.publish, source_model_dir=settings.model_path)
    raise ValueError(f"unknown publisher {settings.publish.kind!r}")
