"""Adapter versions of a LoRA job on a shared engine pool: written as PEFT directories, loaded into every engine.

A LoRA job on a shared pool never publishes weights: the pool serves the base model for every job on it, and each
version of a job is a PEFT adapter (`adapter_config.json` + `adapter_model.safetensors`, a few MB where the base is
GBs). `PoolAdapters.roll` loads version N into every engine of the pool with SGLang's `/load_lora_adapter` under
`<job_id>@<N>` (miles.common.contracts.adapters) while the engines keep serving: loading an adapter touches neither
the base weights nor any other adapter, so there is no pause, no drain and no version lock as in a weight update.
Versions stay honest per adapter by construction: a request names the exact version it is served with.

The version becomes live (the session server names it on new requests) only once **every** engine of the pool
holds it; an engine that did not take it fails the roll with a retryable error, and the publisher retries (a load
of a name already loaded counts as done, so a retry or a restarted trainer republishing its version is
idempotent). `retire` then unloads this job's versions older than the newest `keep_loaded`: the previous one
stays for requests that read the old live name just before the switch. SGLang removes an unloaded adapter from
its registry at once and frees it when its in-flight requests ended, so nothing running is cut. Versions that a
dead predecessor left loaded are found in the engines' `loaded_adapters` answers and retired the same way.

Limits: an engine that joins the pool (or restarts) between two publishes holds no adapter of the job until the
live version is rolled again (the trainer's publisher does so every few seconds), and answers the job's requests
there with 400 meanwhile (the session server's retry covers only a moved live version). Engines the router
reports unhealthy are skipped and get the version at the next roll.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from miles.common.contracts.adapters import adapter_name, parse_adapter_name
from miles.weightsync.engine_client import EngineClient, RouterClient
from miles.weightsync.errors import EngineUnreachableError, EngineUpdateError

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

ADAPTER_CONFIG_FILE = "adapter_config.json"
ADAPTER_WEIGHTS_FILE = "adapter_model.safetensors"
ALREADY_LOADED = "already loaded"
"""SGLang's refusal of a name that is loaded ("Failed to load LoRA adapter X because it is already loaded")."""
NOT_LOADED = "does not exist"
"""SGLang's refusal to unload an unknown name ("LoRA with name X does not exist. Loaded LoRAs: ...")."""


def write_adapter_dir(path: Path, tensors: Mapping[str, torch.Tensor], config: Mapping[str, Any]) -> None:
    """A PEFT adapter directory at `path`, written beside it and renamed into place (readers never see half)."""
    from safetensors.torch import save_file

    if path.exists():
        return  # a version's directory is never rewritten: its name stands for its bytes
    temp = path.parent / f".tmp-{path.name}-{uuid.uuid4().hex[:8]}"
    temp.mkdir(parents=True)
    try:
        save_file({name: t.contiguous() for name, t in tensors.items()}, str(temp / ADAPTER_WEIGHTS_FILE))
        (temp / ADAPTER_CONFIG_FILE).write_text(json.dumps(dict(config), indent=2, sort_keys=True, default=_sorted))
        for file in temp.iterdir():
            with open(file, "rb") as handle:
                os.fsync(handle.fileno())
        os.rename(temp, path)
    except BaseException:
        shutil.rmtree(temp, ignore_errors=True)
        raise


def _sorted(value: object) -> object:
    """JSON for what peft's LoraConfig.to_dict leaves as sets (target_modules), as save_pretrained writes it."""
    if isinstance(value, (set, frozenset)):
        return sorted(value)
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


@dataclass
class AdapterLoad:
    """One engine's answer to one version's load."""

    engine_url: str
    error: str = ""

    @property
    def failed(self) -> bool:
        return bool(self.error)


class PoolAdapters:
    """One job's adapter versions on the engines of a router pool (plus static URLs)."""

    def __init__(
        self,
        job_id: str,
        router: RouterClient | None,
        static_urls: list[str],
        *,
        timeout_s: float,
        engine_admin_api_key: str = "",
        keep_loaded: int = 2,
    ) -> None:
        if keep_loaded < 2:
            raise ValueError("keep_loaded must be >= 2: the previous version serves requests sent before the switch")
        self.job_id = job_id
        self.router = router
        self.static_urls = [url.rstrip("/") for url in static_urls]
        self.timeout_s = timeout_s
        self.keep_loaded = keep_loaded
        self._admin_api_key = engine_admin_api_key
        self._clients: dict[str, EngineClient] = {}
        self._loaded: dict[str, set[int]] = {}
        """Per engine: this job's versions it reported loaded in its last answer."""

    async def discover(self) -> list[str]:
        """The engines a version must reach: the pool's, less those the router reports unhealthy."""
        urls = list(self.static_urls)
        if self.router is not None:
            for engine in await self.router.list_engines():
                if engine.get("state") != "unhealthy":
                    urls.append(str(engine["url"]).rstrip("/"))
        return list(dict.fromkeys(urls))

    async def roll(self, version: int, path: Path) -> list[AdapterLoad]:
        """Load `version` (the PEFT directory `path`, readable by the engines at that path) into every engine."""
        urls = await self.discover()
        if not urls:
            raise EngineUnreachableError(f"the pool of job {self.job_id} has no engine to load the adapter into")
        name = adapter_name(self.job_id, version)
        return list(await asyncio.gather(*(self._load(url, name, str(path)) for url in urls)))

    async def retire(self, live_version: int) -> int:
        """Unload this job's versions older than the newest `keep_loaded` (up to `live_version`) on every engine
        that reported them; return how many were unloaded. Failures are logged: a version left loaded costs a
        slot, never a wrong answer."""
        oldest_kept = live_version - self.keep_loaded + 1
        return await self._unload(lambda version: version < oldest_kept)

    async def unload_all(self) -> int:
        """Unload every version of this job that an engine reported loaded (the job is over: its slots go back to
        the pool); how many were unloaded. Best effort, as `retire`."""
        return await self._unload(lambda _: True)

    async def _unload(self, wanted: Callable[[int], bool]) -> int:
        unloaded = 0
        for url, versions in list(self._loaded.items()):
            for version in sorted(v for v in versions if wanted(v)):
                try:
                    await self._call(url, "/unload_lora_adapter", {"lora_name": adapter_name(self.job_id, version)})
                except (EngineUpdateError, EngineUnreachableError) as exc:
                    if NOT_LOADED not in str(exc):
                        log.warning("adapter unload failed", extra={"engine_url": url, "error": str(exc)})
                        continue
                versions.discard(version)
                unloaded += 1
        return unloaded

    async def close(self) -> None:
        for client in self._clients.values():
            await client.close()
        self._clients.clear()

    async def _load(self, url: str, name: str, path: str) -> AdapterLoad:
        try:
            await self._call(url, "/load_lora_adapter", {"lora_name": name, "lora_path": path, "pinned": False})
        except (EngineUpdateError, EngineUnreachableError) as exc:
            if ALREADY_LOADED not in str(exc):
                return AdapterLoad(url, str(exc))
            self._loaded.setdefault(url, set()).add(version_of(name))
        return AdapterLoad(url)

    async def _call(self, url: str, route: str, body: dict[str, Any]) -> None:
        client = self._clients.get(url)
        if client is None:
            client = self._clients[url] = EngineClient(url, self.timeout_s, admin_api_key=self._admin_api_key)
        payload = await client.request("POST", route, body, check_success=True)
        loaded = payload.get("loaded_adapters") if isinstance(payload, dict) else None
        if isinstance(loaded, dict):
            names = (parse_adapter_name(str(name)) for name in loaded)
            self._loaded[url] = {parsed[1] for parsed in names if parsed is not None and parsed[0] == self.job_id}


def version_of(name: str) -> int:
    parsed = parse_adapter_name(name)
    assert parsed is not None, name
    return parsed[1]
