"""The live adapter of a LoRA job on a shared engine pool: what the trainer publishes, what each turn is served with.

A LoRA job (job config `lora_adapter: true`) shares an engine pool whose base weights never change; the trainer
publishes adapter versions instead. It loads version v into every engine of the pool under the SGLang lora_name
`<job_id>@<v>` (`miles.common.contracts.adapters`), then sets it live here (`PUT /v1/jobs/{job_id}/adapter`).
Every turn of the job then:
- reads the live adapter fresh (one store read, no cache: a switch reaches the next turn on every replica),
  waiting for a first one up to adapter_wait_s (polling every 0.2 s), else 503 `adapter_not_published`;
- sends its name as `lora_path` in the /generate body, which is built field by field (upstream.py), so an agent
  can never pick an adapter itself;
- records weight_version = the version parsed from the name it sent, never the engine's (the pool's base version);
- when the engine answers 400 "not loaded" (the trainer unloads old versions after a switch, so a turn that read
  the old name just before the switch can meet it), re-reads the live adapter and, if it moved, retries once.

Owns the checks of a PUT (the name reads back as the job and version, the job is a LoRA job, the version never
goes down); the store makes the set atomic. Limits: nothing here checks that the named adapter really is loaded on
every engine of the pool: setting it live is the trainer's promise that it is.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

from miles.common.contracts.adapters import parse_adapter_name
from miles.session.api_models import JobAdapterBody
from miles.session.errors import (
    AdapterNotEnabledError,
    AdapterNotFoundError,
    AdapterNotPublishedError,
    AdapterVersionRegressedError,
    InvalidRequestError,
    JobNotFoundError,
    UpstreamRejectedError,
)
from miles.session.metrics import SessionMetrics
from miles.session.records import LiveAdapter
from miles.session.store import SessionStore
from miles.session.upstream import Completion

NOT_LOADED_MESSAGE = "The following requested LoRA adapters are not loaded"
"""SGLang's 400 for a `lora_path` that names no loaded adapter (docs/sglang-protocol.md §10)."""
POLL_INTERVAL_S = 0.2
NOT_PUBLISHED_RETRY_AFTER_S = 5.0

T = TypeVar("T")
Generate = Callable[[str], Awaitable[Completion]]
"""One /generate call of a turn with the given `lora_path`."""


def served_with(completion: Completion, adapter: LiveAdapter) -> Completion:
    """`completion` recording the adapter version it was served with as its weight_version."""
    # The engine's spans would name the pool's base version; an adapter is never swapped under a running call.
    return dataclasses.replace(completion, weight_version=sent_version(adapter.lora_name), weight_version_spans=None)


def sent_version(lora_name: str) -> str:
    """The weight_version a turn served with `lora_name` records: the version in the name."""
    parsed = parse_adapter_name(lora_name)
    if parsed is None:  # the store holds only names that put() checked: a bug, not a caller's mistake
        raise RuntimeError(f"the live adapter name {lora_name!r} is not <job_id>@<version>")
    return str(parsed[1])


class JobAdapters:
    def __init__(self, store: SessionStore, metrics: SessionMetrics, *, wait_s: float) -> None:
        self._store = store
        self._metrics = metrics
        self._wait_s = wait_s

    async def put(self, job_id: str, body: JobAdapterBody) -> LiveAdapter:
        """Make `body` the job's live adapter (module docstring); the live adapter after the call."""
        if parse_adapter_name(body.lora_name) != (job_id, body.weight_version):
            raise InvalidRequestError(
                f"lora_name {body.lora_name!r} must be '<job_id>@<weight_version>', here "
                f"{job_id}@{body.weight_version}",
                field="lora_name",
            )
        config = await self._store.get_job_config(job_id)
        if config is None:
            raise JobNotFoundError(f"no model config is registered for job {job_id!r}", field="job_id")
        if not config.lora_adapter:
            raise AdapterNotEnabledError(
                f"job {job_id!r} is not a LoRA job: PUT its config with lora_adapter true first", field="job_id"
            )
        live = await self._store.set_adapter(job_id, LiveAdapter(body.lora_name, body.weight_version))
        if live is None:  # the config was deleted since it was read
            raise JobNotFoundError(f"no model config is registered for job {job_id!r}", field="job_id")
        if live.weight_version > body.weight_version:
            raise AdapterVersionRegressedError(
                f"job {job_id!r} serves adapter version {live.weight_version} already; weight_version "
                f"{body.weight_version} would go back",
                field="weight_version",
                details={"live": live.to_json()},
            )
        return live

    async def get(self, job_id: str) -> LiveAdapter:
        adapter = await self._store.get_adapter(job_id)
        if adapter is None:
            raise AdapterNotFoundError(f"job {job_id!r} has no live adapter (unknown job, or none published yet)")
        return adapter

    async def wait_live(self, job_id: str) -> LiveAdapter:
        """The job's live adapter, waiting for a first one up to adapter_wait_s; 503 adapter_not_published after."""
        deadline_s = time.monotonic() + self._wait_s
        while True:
            adapter = await self._store.get_adapter(job_id)
            if adapter is not None:
                return adapter
            remaining_s = deadline_s - time.monotonic()
            if remaining_s <= 0:
                raise AdapterNotPublishedError(
                    f"job {job_id!r} is a LoRA job and no adapter version was published within "
                    f"{self._wait_s:g} s; retry once the trainer published one",
                    retry_after_s=NOT_PUBLISHED_RETRY_AFTER_S,
                )
            await asyncio.sleep(min(POLL_INTERVAL_S, remaining_s))

    async def generate(self, job_id: str, adapter: LiveAdapter, call: Generate) -> Completion:
        """`call` with `adapter`'s name (once more with the new live one when the engine no longer had it); the
        completion's weight_version is the adapter version it was served with."""
        completion, served = await self.call_live(job_id, adapter, call)
        return served_with(completion, served)

    async def call_live(
        self, job_id: str, adapter: LiveAdapter, call: Callable[[str], Awaitable[T]]
    ) -> tuple[T, LiveAdapter]:
        """(`call` with `adapter`'s name, the adapter it ran with): once more with the job's new live adapter when
        the engine no longer had the one named (a streamed turn opens its stream this way)."""
        try:
            return await call(adapter.lora_name), adapter
        except UpstreamRejectedError as exc:
            moved = await self._moved(job_id, adapter) if NOT_LOADED_MESSAGE in exc.message else None
            if moved is None:
                raise
            self._metrics.adapter_retries.inc()
            return await call(moved.lora_name), moved

    async def _moved(self, job_id: str, adapter: LiveAdapter) -> LiveAdapter | None:
        """The job's live adapter when it is no longer `adapter`, else None."""
        live = await self._store.get_adapter(job_id)
        return live if live is not None and live.lora_name != adapter.lora_name else None
