"""LoRA adapters as the engine serves them (SGLang's --enable-lora API), the part that needs no torch.

- `Adapters` (HTTP side): the registry of loaded adapters by name, /load_lora_adapter and /unload_lora_adapter
  with SGLang's refusals and messages, and the name -> id lookup of /generate's `lora_path`. Every load gets a
  fresh `lora_id` (as SGLang's LoRARef), so an adapter loaded again under the same name never meets the cache
  entries of the earlier one.
- `AdapterHold` (SGLang's registry counter, `acquire` / `release`): a planned request holds the adapters it
  resolved until its sequences are in the scheduler, so an unload between the two waits for it instead of
  failing it.
- `AdapterSlots` (scheduler thread): which ids are live, the per-batch adapter limit (--max-loras-per-batch),
  unloads waiting for the adapter's last sequence to end, and each adapter's metrics `job` label.
- `lora_namespace`: the prefix-cache namespace of a sequence. SGLang folds the LoRA id into the radix cache's
  `extra_key`; here an adapter's namespace is a tuple, which no `extra_key` (a string) can equal, so KV never
  crosses adapters or the base model.

Unload, as SGLang's: the adapter leaves the registry at once (a request naming it afterwards is a 400), every
request that resolved it before runs to its end with it (never aborted), then its weights and cache entries are
dropped and the call returns. Unlike SGLang's, the wait for those requests does not hold the load/unload lock: an
adapter unloading stays resident (it counts against --max-loaded-loras), and a load that needs its room waits for
it, but other loads and unloads go on meanwhile, so one job's long requests never delay another job's versions.

What loading reads and checks, and how the adapter's weights are applied, is the runner's (lora.py for the torch
runner). Limits: every loaded adapter is resident (no eviction to a CPU pool as SGLang's --max-loaded-loras
allows), so `pinned` is accepted and reported but changes nothing.
"""

from __future__ import annotations

import asyncio
import collections
import threading
import uuid
import weakref
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from miles.engine.errors import BadRequestError
from miles.engine.metrics import BASE_JOB, OTHER_JOB, EngineMetrics, adapter_job
from miles.engine.radix_cache import CacheNamespace, RadixCache

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


class AdapterHold:
    """The adapters one planned request resolved, held until its sequences are in the scheduler (`release`). A
    plan dropped without being started (a stream whose client left first) releases them when it is collected."""

    def __init__(self, release: Callable[[tuple[str, ...]], None], lora_ids: tuple[str, ...]) -> None:
        self._finalizer = weakref.finalize(self, release, lora_ids)
        self._finalizer.atexit = False

    def release(self) -> None:
        """Let the adapters go (idempotent)."""
        self._finalizer()


class Adapters:
    """The loaded adapters by name. Loads and unloads take turns (SGLang's update lock), except the wait of an
    unload for its adapter's requests, which runs outside the lock (module docstring)."""

    def __init__(
        self,
        runner: Runner,
        scheduler: Scheduler,
        limits: AdapterLimits,
        *,
        enabled: bool,
        max_loaded_loras: int,
        metrics: EngineMetrics | None = None,
    ) -> None:
        self._runner = runner
        self._scheduler = scheduler
        self._limits = limits
        self.enabled = enabled
        self.max_loaded_loras = max_loaded_loras
        self._metrics = metrics
        self._refs: dict[str, AdapterRef] = {}
        self._unloading: set[str] = set()
        """lora_ids out of the registry whose requests have not all ended: still resident."""
        self._changed = asyncio.Condition()
        """The load/unload lock; notified when an unloaded adapter is gone (room for a waiting load)."""
        self._holds: collections.Counter[str] = collections.Counter()
        self._unheld: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Event]] = {}
        """Unloads waiting for their adapter's last hold to go, by lora_id."""
        self._holds_lock = threading.Lock()  # a collected AdapterHold may release from any thread

    @property
    def loaded(self) -> dict[str, str]:
        """lora_name -> lora_path of every loaded adapter (SGLang's `loaded_adapters`)."""
        return {name: ref.lora_path for name, ref in self._refs.items()}

    @property
    def num_unloading(self) -> int:
        """Adapters unloaded but still resident, waiting for their last requests to end."""
        return len(self._unloading)

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

    def hold(self, lora_ids: Iterable[str | None]) -> AdapterHold | None:
        """Keep the adapters of `lora_ids` (just resolved) from being dropped until the hold is released; None
        when there is none to hold."""
        held = tuple({lora_id for lora_id in lora_ids if lora_id is not None})
        if not held:
            return None
        with self._holds_lock:
            self._holds.update(held)
        return AdapterHold(self._release, held)

    async def load(self, lora_name: str, lora_path: str, pinned: bool = False) -> None:
        """Read, check and install an adapter; LoraError (nothing changed) when it is refused. Waits while the
        room it needs is held by adapters still unloading."""
        async with self._changed:
            try:
                self._check_new(lora_name, lora_path)
                if not self._has_room():
                    await self._changed.wait_for(self._has_room)  # lets the lock go meanwhile
                    self._check_new(lora_name, lora_path)
                prepared = await asyncio.to_thread(self._runner.prepare_adapter, lora_path, self._limits)
                lora_id = uuid.uuid4().hex
                await asyncio.wrap_future(self._scheduler.add_adapter(lora_id, prepared, adapter_job(lora_name)))
            except LoraError:
                self._observe("load", ok=False)
                raise
            self._refs[lora_name] = AdapterRef(lora_id, lora_name, lora_path, pinned)
            self._observe("load", ok=True)

    def load_at_start(self, lora_name: str, lora_path: str) -> None:
        """`load` for --lora-paths, before serving (the scheduler runs; no event loop yet)."""
        self._check_new(lora_name, lora_path)
        prepared = self._runner.prepare_adapter(lora_path, self._limits)
        lora_id = uuid.uuid4().hex
        self._scheduler.add_adapter(lora_id, prepared, adapter_job(lora_name)).result()
        self._refs[lora_name] = AdapterRef(lora_id, lora_name, lora_path, False)
        self._observe("load", ok=True)

    async def unload(self, lora_name: str) -> None:
        """Stop serving `lora_name` at once (new requests naming it get a 400); the requests that resolved it
        before finish with it, then its weights and cache entries are dropped, and this returns."""
        async with self._changed:
            try:
                ref = self._take(lora_name)
            except LoraError:
                self._observe("unload", ok=False)
                raise
            self._unloading.add(ref.lora_id)
            self._observe("unload", ok=True)
        # Shielded: a caller that leaves (client gone) must not leave the adapter resident for ever.
        await asyncio.shield(self._drop_when_unused(ref.lora_id))

    async def _drop_when_unused(self, lora_id: str) -> None:
        try:
            await self._until_unheld(lora_id)  # the requests planned with it are in the scheduler now
            await asyncio.wrap_future(self._scheduler.remove_adapter(lora_id))
        finally:
            async with self._changed:
                self._unloading.discard(lora_id)
                self._changed.notify_all()
                self._publish()

    def _take(self, lora_name: str) -> AdapterRef:
        if not self.enabled:
            raise LoraError(LORA_NOT_ENABLED)
        ref = self._refs.pop(lora_name, None)
        if ref is None:
            raise LoraError(f"LoRA with name {lora_name} does not exist. Loaded LoRAs: {sorted(self._refs)}")
        return ref

    async def _until_unheld(self, lora_id: str) -> None:
        """Returns once no plan holds `lora_id` (no new hold can come: it left the registry)."""
        event = asyncio.Event()
        with self._holds_lock:
            if self._holds[lora_id] <= 0:
                return
            self._unheld[lora_id] = (asyncio.get_running_loop(), event)
        await event.wait()

    def _release(self, lora_ids: tuple[str, ...]) -> None:
        with self._holds_lock:
            self._holds.subtract(lora_ids)
            for lora_id in lora_ids:
                if self._holds[lora_id] > 0:
                    continue
                del self._holds[lora_id]
                loop, event = self._unheld.pop(lora_id, (None, None))
                if loop is not None and event is not None and not loop.is_closed():
                    loop.call_soon_threadsafe(event.set)

    def _has_room(self) -> bool:
        return len(self._refs) + len(self._unloading) < self.max_loaded_loras

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

    def _observe(self, kind: str, *, ok: bool) -> None:
        if self._metrics is not None:
            self._metrics.observe_lora_update(kind, ok)
        self._publish()

    def _publish(self) -> None:
        if self._metrics is not None:
            self._metrics.loaded_lora_adapters.set(len(self._refs) + len(self._unloading))
            self._metrics.set_adapter_slots(collections.Counter(adapter_job(name) for name in self._refs))


@dataclass
class AdapterSlots:
    """Scheduler-thread bookkeeping of adapters: live ids, the per-batch limit, unloads in waiting, and the
    metrics `job` label of each installed adapter."""

    max_loras_per_batch: int
    live: set[str] = field(default_factory=set)
    removals: list[tuple[str, Future[None]]] = field(default_factory=list)
    jobs: dict[str, str] = field(default_factory=dict)

    def fits(self, batch_ids: Iterable[str | None], lora_id: str | None) -> bool:
        """Whether a sequence of `lora_id` may join a batch whose sequences run `batch_ids`."""
        if lora_id is None:
            return True
        distinct = {i for i in batch_ids if i is not None}
        return lora_id in distinct or len(distinct) < self.max_loras_per_batch

    def job_of(self, lora_id: str | None) -> str:
        """The metrics `job` label of a sequence running `lora_id`."""
        return BASE_JOB if lora_id is None else self.jobs.get(lora_id, OTHER_JOB)

    def install(self, runner: Runner, lora_id: str, prepared: object, job: str) -> None:
        runner.add_adapter(lora_id, prepared)
        self.live.add(lora_id)
        self.jobs[lora_id] = job

    def drop_unused(
        self, in_use: set[str | None], runner: Runner, cache: RadixCache, metrics: EngineMetrics | None
    ) -> None:
        """Drop the pending unloads' adapters that no sequence uses any more: weights, cache entries and (for the
        job's last adapter) its metrics series; then resolve their futures."""
        due = [(lora_id, future) for lora_id, future in self.removals if lora_id not in in_use]
        self.removals = [(lora_id, future) for lora_id, future in self.removals if lora_id in in_use]
        for lora_id, future in due:
            runner.remove_adapter(lora_id)
            cache.drop_namespaces(keep_all_but(lora_id))
            job = self.jobs.pop(lora_id, None)
            if metrics is not None and job is not None and job not in self.jobs.values():
                metrics.forget_job(job)
            future.set_result(None)


def keep_all_but(lora_id: str) -> Callable[[CacheNamespace], bool]:
    """A `RadixCache.drop_namespaces` predicate keeping every namespace but those of `lora_id`."""

    def keep(namespace: CacheNamespace) -> bool:
        return not (isinstance(namespace, tuple) and len(namespace) > 1 and namespace[1] == lora_id)

    return keep
