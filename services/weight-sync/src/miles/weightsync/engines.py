"""Updating one engine next to this daemon: quiesce, load, set the version, check it, resume.

The protocol for one engine (sglang-protocol.md §3, miles-agentic.md §6.2):

1. quiesce — `drain`: DrainEngine at the router and wait until nothing is in flight (new requests go to other
   engines); `abort` / `retract` / `in_place`: DrainEngine without waiting, then /pause_generation with that mode
   (held requests resume on the new weights: the job's partial-rollout choice);
2. load through the transport (its last call carries weight_version);
3. /update_weight_version (without aborting) and read /model_info back: it must report the new version;
4. resume — /continue_generation when paused, then UndrainEngine (the router re-reads the version).

Version lock: the engine takes no request between 1 and 4, so it never serves a mix of versions. If any step
fails or the per-engine timeout passes, the engine is left drained at the router and paused (so not even direct
clients reach weights that may be half-loaded), marked failed with the error, and what this daemon believed the
engine holds is forgotten (the next update loads in full). The next successful update resumes and undrains it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

from miles.common.errors import MilesError
from miles.weightsync.engine_client import EngineClient, RouterClient
from miles.weightsync.errors import EngineUpdateError, UnsupportedTransportError
from miles.weightsync.events import ENGINE_UPDATE_FAILED, ENGINE_UPDATED, EventLog, VersionEvent
from miles.weightsync.metrics import WeightsyncMetrics
from miles.weightsync.transports import WeightTransport
from miles.weightsync.weights import WeightSet

log = logging.getLogger(__name__)
PAUSE_MODES = ("drain", "abort", "retract", "in_place")


@dataclass
class EngineOutcome:
    """The result of one engine's last update, as GetVersion / UpdateEngines report it."""

    engine_url: str
    weight_version: int = -1
    update_failed: bool = False
    error: str = ""
    fell_back: bool = False
    update_duration_s: float = 0.0
    daemon: str = ""


@dataclass
class _EngineState:
    client: EngineClient
    weights: WeightSet | None = None
    outcome: EngineOutcome = field(default_factory=lambda: EngineOutcome(""))
    left_paused: bool = False
    stage: str = "quiesce"
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)


def parse_version(label: str | None) -> int:
    """SGLang's weight_version string as an integer; -1 when absent or not an integer ("default")."""
    try:
        return int(label) if label is not None else -1
    except ValueError:
        return -1


class LocalEngines:
    """The engines this daemon loads itself, with what it last loaded into each."""

    def __init__(
        self,
        urls: list[str],
        *,
        router: RouterClient | None,
        metrics: WeightsyncMetrics,
        events: EventLog,
        request_timeout_s: float,
    ) -> None:
        self.router = router
        self.metrics = metrics
        self.events = events
        self._engines = {
            url.rstrip("/"): _EngineState(EngineClient(url, request_timeout_s)) for url in dict.fromkeys(urls)
        }
        for url, state in self._engines.items():
            state.outcome.engine_url = url

    @property
    def urls(self) -> list[str]:
        return list(self._engines)

    async def close(self) -> None:
        for state in self._engines.values():
            await state.client.close()

    async def outcomes(self) -> list[EngineOutcome]:
        """Each engine's last outcome, with the version it reports right now (-1 when it cannot be read)."""
        result = []
        for url, state in self._engines.items():
            try:
                live = parse_version(await asyncio.wait_for(state.client.weight_version(), 5.0))
            except (MilesError, TimeoutError):
                live = -1
            self.metrics.engine_version.labels(url).set(live)
            result.append(EngineOutcome(**{**state.outcome.__dict__, "weight_version": live}))
        return result

    async def update(
        self, url: str, version: int, transport: WeightTransport, pause_mode: str, timeout_s: float
    ) -> EngineOutcome:
        state = self._engines.get(url.rstrip("/"))
        if state is None:
            raise UnsupportedTransportError(f"engine {url} is not one of this daemon's engines", field="engine_urls")
        if pause_mode == "drain" and self.router is None:
            raise UnsupportedTransportError("pause mode drain needs a router (router_url)", field="pause_mode")
        async with state.lock:
            start_s = time.perf_counter()
            try:
                async with asyncio.timeout(timeout_s):
                    mode = await self._update_quiesced(state, version, transport, pause_mode, timeout_s)
            except Exception as exc:  # any failure must leave the engine drained and reported, never serving
                await self._fail(state, version, exc)
            else:
                elapsed_s = time.perf_counter() - start_s
                state.outcome = EngineOutcome(
                    state.outcome.engine_url, version, False, "", mode == "fallback", elapsed_s
                )
                self.metrics.engine_updates.labels(transport.name, mode).inc()
                self.metrics.engine_version.labels(state.outcome.engine_url).set(version)
                self.metrics.observe_phase("engine_update", elapsed_s)
                await self.events.emit(
                    VersionEvent(ENGINE_UPDATED, version, state.outcome.engine_url, fell_back=mode == "fallback")
                )
            state.outcome.update_duration_s = time.perf_counter() - start_s
            return EngineOutcome(**state.outcome.__dict__)

    async def _update_quiesced(
        self, state: _EngineState, version: int, transport: WeightTransport, pause_mode: str, timeout_s: float
    ) -> str:
        url = state.outcome.engine_url
        with self._stage(state, "quiesce"):
            if self.router is not None:
                drained = await self.router.drain(url, wait=pause_mode == "drain", timeout_s=timeout_s)
                if pause_mode == "drain" and not drained:
                    raise EngineUpdateError(f"engine {url} still had requests in flight after {timeout_s}s")
            if pause_mode != "drain":
                await state.client.pause(pause_mode)
                state.left_paused = True
        current, state.weights = state.weights, None  # unknown until the load is confirmed
        with self._stage(state, "load"):
            result = await transport.load(state.client, version, current)
        with self._stage(state, "set_version"):
            await state.client.update_weight_version(str(version))
            reported = await state.client.weight_version()
            if parse_version(reported) != version:
                raise EngineUpdateError(f"engine {url} reports version {reported!r} after loading {version}")
        state.weights = result.weights
        self.metrics.bytes_to_engines.labels(transport.name).inc(result.bytes_to_engine)
        with self._stage(state, "resume"):
            if state.left_paused:
                await state.client.resume()
                state.left_paused = False
            if self.router is not None:
                await self.router.undrain(url)
        return result.mode

    @contextlib.contextmanager
    def _stage(self, state: _EngineState, name: str) -> Iterator[None]:
        state.stage = name
        start_s = time.perf_counter()
        try:
            yield
        finally:
            self.metrics.observe_phase(name, time.perf_counter() - start_s)

    async def _fail(self, state: _EngineState, version: int, exc: BaseException) -> None:
        url = state.outcome.engine_url
        message = f"{type(exc).__name__} during {state.stage}: {exc}"
        log.error(
            "engine update failed; engine left drained",
            extra={"engine_url": url, "weight_version": version, "error": message},
        )
        state.weights = None
        state.outcome = EngineOutcome(url, state.outcome.weight_version, True, message, False, 0.0)
        self.metrics.failures.labels(state.stage).inc()
        with contextlib.suppress(Exception):  # best effort: the engine may be what failed
            if self.router is not None:
                await asyncio.wait_for(self.router.drain(url, wait=False, timeout_s=1.0), 10.0)
        with contextlib.suppress(Exception):
            await asyncio.wait_for(state.client.pause("abort"), 10.0)
            state.left_paused = True
        await self.events.emit(VersionEvent(ENGINE_UPDATE_FAILED, version, url, error=message))
