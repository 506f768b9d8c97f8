"""LoRA adapters as the engine serves them (SGLang's --enable-lora API), the part that needs no torch.

- `Adapters` (HTTP side): the registry of loaded adapters by name, /load_lora_adapter and /unload_lora_adapter
  with SGLang's refusals and messages, and the name -> id lookup of /generate's `lora_path`. Every load gets a
  fresh `lora_id` (as SGLang's LoRARef), so an adapter loaded again under the same name never meets the cache
  entries of the earlier one.
- `AdapterSlots` (scheduler thread): which ids are live, the per-batch adapter limit (--max-loras-per-batch) and
  unloads waiting for the adapter's last sequence to end (SGLang's unload also waits for its requests).
- `lora_namespace`: the prefix-cache namespace of a sequence. SGLang folds the LoRA id into the radix cache's
  `extra_key`; here an adapter's namespace is a tuple, which no `extra_key` (a string) can equal, so KV never
  crosses adapters or the base model.

What loading reads and checks, and how the adapter's weights are applied, is the runner's (lora.py for the torch
runner). Limits: every loaded adapter is resident (no eviction to a CPU pool as SGLang's --max-loaded-loras
allows), so `pinned` is accepted and reported but changes nothing.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from miles.engine.errors import BadRequestError
from miles.engine.radix_cache import CacheNamespace

if TYPE_CHECKING:
    from miles.engine.runner import Runner
    from miles.engine.scheduler import Scheduler

SUPPORTED_TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""Linear layers an adapter may target (PEFT's `target_modules`, SGLang's --lora-target-modules names)."""

LORA_NOT_ENABLED = "LoRA is not enabled: start the engine with --enable-lora to load and use LoRA adapters."


class LoraError(BadRequestError):
    """A LoRA adapter cannot be loaded, unloaded or used as asked (SGLang's 400)."""

    code = "lora_refused"


@dataclass(frozen=True)
class AdapterLimits:
    """What a loaded adapter may be (--max-lora-rank, --lora-target-modules)."""

    max_lora_rank: int | None = None
    """Highest rank `r` accepted (None: any)."""
    target_modules: frozenset[str] = frozenset(SUPPORTED_TARGET_MODULES)
    """Modules an adapter may target: a subset of SUPPORTED_TARGET_MODULES."""


@dataclass(frozen=True)
class AdapterRef:
    lora_id: str
    lora_name: str
    lora_path: str
    pinned: bool


def lora_namespace(lora_id: str | None, extra_key: str | None) -> CacheNamespace:
    """The prefix-cache namespace of a sequence: its extra_key for the base model, a tuple for an adapter."""
    return extra_key if lora_id is None else ("lora", lora_id, extra_key)


def parse_lora_path_spec(spec: str) -> tuple[str, str]:
    """(name, path) of a --lora-paths entry: `NAME=PATH`, or `PATH` (named by its path), as SGLang reads them."""
    name, sep, path = spec.partition("=")
    return (name, path) if sep else (spec, spec)


class Adapters:
    """The loaded adapters by name; load and unload are serialised (one at a time, as SGLang's update lock)."""

    def __init__(
        self,
        runner: Runner,
        scheduler: Scheduler,
        limits: AdapterLimits,
        *,
        enabled: bool,
        max_loaded_loras: int,
    ) -> None:
        self._runner = runner
        self._scheduler = scheduler
        self._limits = limits
        self.enabled = enabled
        self.max_loaded_loras = max_loaded_loras
        self._refs: dict[str, AdapterRef] = {}
        self._lock = asyncio.Lock()

    @property
    def loaded(self) -> dict[str, str]:
        """lora_name -> lora_path of every loaded adapter (SGLang's `loaded_adapters`)."""
        return {name: ref.lora_path for name, ref in self._refs.items()}

    def resolve(self, lora_name: str) -> str:
        """The lora_id serving `lora_name`; LoraError (SGLang's message) when it is not loaded."""
        if not self.enabled:
            raise LoraError(LORA_NOT_ENABLED)
        ref = self._refs.get(lora_name)
        if ref is None:
            raise LoraError(
                f"The following requested LoRA adapters are not loaded: {lora_name}\n"
                f"Loaded adapters: {sorted(self._refs)}."
            )
        return ref.lora_id

    async def load(self, lora_name: str, lora_path: str, pinned: bool = False) -> None:
        """Read, check and install an adapter; LoraError (nothing changed) when it is refused."""
        async with self._lock:
            self._check_new(lora_name, lora_path)
            prepared = await asyncio.to_thread(self._runner.prepare_adapter, lora_path, self._limits)
            lora_id = uuid.uuid4().hex
            await asyncio.wrap_future(self._scheduler.add_adapter(lora_id, prepared))
            self._refs[lora_name] = AdapterRef(lora_id, lora_name, lora_path, pinned)

    def load_at_start(self, lora_name: str, lora_path: str) -> None:
        """`load` for --lora-paths, before serving (the scheduler runs; no event loop yet)."""
        self._check_new(lora_name, lora_path)
        prepared = self._runner.prepare_adapter(lora_path, self._limits)
        lora_id = uuid.uuid4().hex
        self._scheduler.add_adapter(lora_id, prepared).result()
        self._refs[lora_name] = AdapterRef(lora_id, lora_name, lora_path, False)

    async def unload(self, lora_name: str) -> None:
        """Stop serving `lora_name` at once (new requests naming it get a 400); its sequences in flight finish
        with it, then its weights and cache entries are dropped, and this returns."""
        async with self._lock:
            if not self.enabled:
                raise LoraError(LORA_NOT_ENABLED)
            ref = self._refs.pop(lora_name, None)
            if ref is None:
                raise LoraError(f"LoRA with name {lora_name} does not exist. Loaded LoRAs: {sorted(self._refs)}")
            await asyncio.wrap_future(self._scheduler.remove_adapter(ref.lora_id))

    def _check_new(self, lora_name: str, lora_path: str) -> None:
        if not self.enabled:
            raise LoraError(LORA_NOT_ENABLED)
        if not lora_name or not lora_path:
            raise LoraError("lora_name and lora_path must both be non-empty")
        if lora_name in self._refs:
            raise LoraError(f"Failed to load LoRA adapter {lora_name} because it is already loaded")
        if len(self._refs) >= self.max_loaded_loras:
            raise LoraError(
                f"Cannot load LoRA adapter {lora_name} at path {lora_path}. "
                f"Maximum number of loaded LoRA adapters is {self.max_loaded_loras}. "
                "Please unload some LoRA adapters before loading new ones."
            )


@dataclass
class AdapterSlots:
    """Scheduler-thread bookkeeping of adapters: live ids, the per-batch limit, unloads in waiting."""

    max_loras_per_batch: int
    live: set[str] = field(default_factory=set)
    removals: list[tuple[str, Future[None]]] = field(default_factory=list)

    def fits(self, batch_ids: Iterable[str | None], lora_id: str | None) -> bool:
        """Whether a sequence of `lora_id` may join a batch whose sequences run `batch_ids`."""
        if lora_id is None:
            return True
        distinct = {i for i in batch_ids if i is not None}
        return lora_id in distinct or len(distinct) < self.max_loras_per_batch

    def due_removals(self, in_use: set[str | None]) -> list[tuple[str, Future[None]]]:
        """Pending unloads whose adapter no sequence uses any more (taken off the pending list)."""
        due = [(lora_id, future) for lora_id, future in self.removals if lora_id not in in_use]
        self.removals = [(lora_id, future) for lora_id, future in self.removals if lora_id in in_use]
        return due


def keep_all_but(lora_id: str) -> Callable[[CacheNamespace], bool]:
    """A `RadixCache.drop_namespaces` predicate keeping every namespace but those of `lora_id`."""

    def keep(namespace: CacheNamespace) -> bool:
        return not (isinstance(namespace, tuple) and len(namespace) > 1 and namespace[1] == lora_id)

    return keep
