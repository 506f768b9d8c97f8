"""Updating one engine next to this daemon: quiesce, load, set the version, check it, resume.

The protocol for one engine (docs/sglang-protocol.md §3, docs/life-of-a-weight-version.md):

0. prepare through the transport while the engine keeps serving: fetch, decode, verify, encode (transports.py);
1. quiesce — `drain`: DrainEngine at the router and wait until nothing is in flight (new requests go to other
   engines), then /pause_generation in_place (holds clients that bypass the router); `abort` / `retract` /
   `in_place`: DrainEngine without waiting, then /pause_generation with that mode (held requests resume on the
   new weights: the job's partial-rollout choice). The drain's wait is bounded by `drain_timeout_s`: requests
   still in flight then are aborted by /pause_generation abort, and the update goes on. An engine this daemon left
   paused (a failed update) is not waited for at all — requests held by that pause cannot finish before the
   resume — and is paused with abort, which ends whatever it holds without a mix of versions (miles-engine aborts
   held requests; SGLang keeps requests that never passed its pause gate and runs them on the new weights);
2. apply the prepared load (its last call carries weight_version);
3. /update_weight_version (without aborting) and read /model_info back: it must report the new version;
4. resume — /continue_generation, then UndrainEngine (the router re-reads the version).

The engine pauses from its /pause_generation in 1 to 4 only (`pause_s`; a drain's wait for in-flight requests,
which the engine still serves, comes before); 0 is `transfer_s`. Both, the bytes moved and the time from the
trainer's optimizer step to the engine serving the version (`step_to_serving_s`) are exported per update.

Version lock: the engine takes no request between 1 and 4, so it never serves a mix of versions. If any step
fails or the per-engine timeout passes, the engine is left drained at the router and paused (so not even direct
clients reach weights that may be half-loaded), marked failed with the error, and what this daemon believed the
engine holds is forgotten (the next update loads in full). The next successful update resumes and undrains it.
If the router was unreachable then (or restarted since), the engine is not drained there: the router's own
generation check keeps a paused engine out of routing (rollout-router monitor.py).

Bounds: the whole update by the per-engine timeout (sized for loads), the drain's wait by `drain_timeout_s`, each
control call (pause, continue, version) by `control_timeout_s` (engine_client.py), the failure path's calls by
`FAIL_CALL_TIMEOUT_S` each. Limits: `left_paused` lives in this process; a daemon restarted after leaving an engine
paused waits up to `drain_timeout_s` for requests the pause holds (then aborts them), and an engine left paused at
the latest version is not updated again, so nothing resumes it (the router keeps it out of routing).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

from miles.common.contracts.weight_version import UNKNOWN_WEIGHT_VERSION, parse_weight_version
from miles.common.errors import MilesError
from miles.weightsync.engine_client import EngineClient, RouterClient
from miles.weightsync.errors import EngineUpdateError, UnsupportedTransportError
from miles.weightsync.events import ENGINE_UPDATE_FAILED, ENGINE_UPDATED, EventLog, VersionEvent
from miles.weightsync.metrics import WeightsyncMetrics
from miles.weightsync.transports import LoadResult, PreparedLoad, WeightTransport
from miles.weightsync.weights import WeightSet

log = logging.getLogger(__name__)
DEFAULT_DRAIN_TIMEOUT_S = 60.0  # the settings' defaults, for callers that build LocalEngines themselves
DEFAULT_CONTROL_TIMEOUT_S = 30.0
FAIL_CALL_TIMEOUT_S = 10.0  # each best-effort call of the failure path (drain, pause)
VERSION_READ_TIMEOUT_S = 5.0  # each engine's version read for GetVersion (all engines at once)


@dataclass
class EngineOutcome:
    """The result of one engine's last update, as GetVersion / UpdateEngines report it."""

    engine_url: str
    weight_version: int = UNKNOWN_WEIGHT_VERSION
    update_failed: bool = False
    error: str = ""
    fell_back: bool = False
    update_duration_s: float = 0.0
    daemon: str = ""
    pause_s: float = 0.0
    transfer_s: float = 0.0
    wire_bytes: int = 0
    step_to_serving_s: float = 0.0


@dataclass
class _EngineState:
    client: EngineClient
    weights: WeightSet | None = None
    outcome: EngineOutcome = field(default_factory=lambda: EngineOutcome(""))
    left_paused: bool = False
    stage: str = "quiesce"
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)


def _since(unix_ms: int) -> float:
    """Seconds from `unix_ms` (another process's wall clock) until now; 0 when unknown."""
    return max(0.0, time.time() - unix_ms / 1000) if unix_ms > 0 else 0.0


def reported_version(label: str | None) -> int:
    """An engine's reported weight_version as GetVersion carries it: "default" is version 0 (the initial weights),
    a label that is no version is UNKNOWN_WEIGHT_VERSION, behind every stored version (miles.common.contracts)."""
    version = parse_weight_version(label)
    return UNKNOWN_WEIGHT_VERSION if version is None else version


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
        engine_admin_api_key: str = "",
        engine_api_key: str = "",
        drain_timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S,
        control_timeout_s: float = DEFAULT_CONTROL_TIMEOUT_S,
    ) -> None:
        """`engine_admin_api_key` goes with every request to these engines, `engine_api_key` (when set) with the
        version reads in its place ("" = open; see EngineClient). `request_timeout_s` bounds each load call,
        `control_timeout_s` each control call, `drain_timeout_s` a drain's wait for in-flight requests."""
        self.router = router
        self.metrics = metrics
        self.events = events
        self.drain_timeout_s = drain_timeout_s
        self._engines = {
            url.rstrip("/"): _EngineState(
                EngineClient(
                    url,
                    request_timeout_s,
                    admin_api_key=engine_admin_api_key,
                    api_key=engine_api_key,
                    control_timeout_s=control_timeout_s,
                )
            )
            for url in dict.fromkeys(urls)
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
        """Each engine's last outcome, with the version it reports right now (-1 when it cannot be read within
        VERSION_READ_TIMEOUT_S; the engines are asked at once, so dead ones cost that once, not once each)."""

        async def live_version(state: _EngineState) -> int:
            try:
                return reported_version(await asyncio.wait_for(state.client.weight_version(), VERSION_READ_TIMEOUT_S))
            except (MilesError, TimeoutError):
                return UNKNOWN_WEIGHT_VERSION

        states = list(self._engines.items())
        versions = await asyncio.gather(*(live_version(state) for _, state in states))
        result = []
        for (url, state), live in zip(states, versions, strict=True):
            self.metrics.engine_version.labels(url).set(live)
            result.append(EngineOutcome(**{**state.outcome.__dict__, "weight_version": live}))
        return result

    async def update(
        self,
        url: str,
        version: int,
        transport: WeightTransport,
        pause_mode: str,
        timeout_s: float,
        *,
        step_finished_unix_ms: int = 0,
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
                    with self._stage(state, "prepare"):
                        prepared = await transport.prepare(state.outcome.engine_url, version, state.weights)
                        prepared = await transport.stage(state.client, prepared)
                    prepared_s = time.perf_counter()
                    result, paused_at_s = await self._swap(state, prepared, transport, pause_mode)
                    pause_s = time.perf_counter() - paused_at_s
            except Exception as exc:  # any failure must leave the engine drained and reported, never serving
                await self._fail(state, version, exc)
            else:
                state.outcome = EngineOutcome(
                    state.outcome.engine_url,
                    version,
                    fell_back=result.mode == "fallback",
                    update_duration_s=time.perf_counter() - start_s,
                    pause_s=pause_s,
                    transfer_s=prepared_s - start_s,
                    wire_bytes=prepared.received_bytes + result.bytes_to_engine,
                    step_to_serving_s=_since(step_finished_unix_ms),
                )
                await self._record_success(state.outcome, transport.name, result.mode)
            state.outcome.update_duration_s = time.perf_counter() - start_s
            return EngineOutcome(**state.outcome.__dict__)

    async def _record_success(self, outcome: EngineOutcome, transport: str, mode: str) -> None:
        m = self.metrics
        m.engine_updates.labels(transport, mode).inc()
        m.engine_version.labels(outcome.engine_url).set(outcome.weight_version)
        m.observe_phase("engine_update", outcome.update_duration_s)
        m.engine_pause_s.observe(outcome.pause_s)
        m.update_transfer_s.observe(outcome.transfer_s)
        m.update_wire_bytes.observe(outcome.wire_bytes)
        if outcome.step_to_serving_s > 0:
            m.step_to_serving_s.observe(outcome.step_to_serving_s)
        await self.events.emit(
            VersionEvent(
                ENGINE_UPDATED,
                outcome.weight_version,
                outcome.engine_url,
                fell_back=outcome.fell_back,
                pause_s=outcome.pause_s,
                transfer_s=outcome.transfer_s,
                wire_bytes=outcome.wire_bytes,
                step_to_serving_s=outcome.step_to_serving_s,
            )
        )

    async def _swap(
        self, state: _EngineState, prepared: PreparedLoad, transport: WeightTransport, pause_mode: str
    ) -> tuple[LoadResult, float]:
        """Quiesce, apply the prepared load, set and check the version, resume: the only time the engine pauses.
        Returns the result and when the engine stopped serving (the pause; a drain's wait for in-flight requests to
        finish comes before it, while the engine still serves them)."""
        url, version = state.outcome.engine_url, prepared.version
        with self._stage(state, "quiesce"):
            paused_at_s = await self._quiesce(state, pause_mode)
        state.weights = None  # unknown until the load is confirmed
        with self._stage(state, "load"):
            result = await transport.apply(state.client, prepared)
        with self._stage(state, "set_version"):
            await state.client.update_weight_version(str(version))
            reported = await state.client.weight_version()
            if reported_version(reported) != version:
                raise EngineUpdateError(f"engine {url} reports version {reported!r} after loading {version}")
        state.weights = result.weights
        self.metrics.bytes_to_engines.labels(transport.name).inc(result.bytes_to_engine)
        with self._stage(state, "resume"):
            await state.client.resume()
            state.left_paused = False
            if self.router is not None:
                await self.router.undrain(url)
        return result, paused_at_s

    async def _quiesce(self, state: _EngineState, pause_mode: str) -> float:
        """Drain at the router (waiting at most drain_timeout_s, see the module docstring), then pause; returns when
        the pause began."""
        url = state.outcome.engine_url
        pause = "in_place" if pause_mode == "drain" else pause_mode
        if self.router is not None:
            wait = pause_mode == "drain" and not state.left_paused
            drained = await self.router.drain(url, wait=wait, timeout_s=self.drain_timeout_s)
            if pause_mode == "drain" and not drained:
                reason = "left_paused" if state.left_paused else "timeout"
                self.metrics.drain_waits_cut.labels(reason).inc()
                log.warning(
                    "requests still in flight at the router: the engine is paused with abort",
                    extra={"engine_url": url, "reason": reason, "drain_timeout_s": self.drain_timeout_s},
                )
                pause = "abort"
        # drain: nothing is in flight any more (or it was aborted); the in_place pause only holds clients that reach
        # the engine directly (not through the router), so that none of them meets half-loaded weights.
        paused_at_s = time.perf_counter()
        await state.client.pause(pause)
        state.left_paused = True
        return paused_at_s

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
        state.outcome = EngineOutcome(url, state.outcome.weight_version, True, message)
        self.metrics.failures.labels(state.stage).inc()
        with contextlib.suppress(Exception):  # best effort: the engine may be what failed
            if self.router is not None:
                await asyncio.wait_for(self.router.drain(url, wait=False, timeout_s=1.0), FAIL_CALL_TIMEOUT_S)
        with contextlib.suppress(Exception):
            await asyncio.wait_for(state.client.pause("abort"), FAIL_CALL_TIMEOUT_S)
            state.left_paused = True
        await self.events.emit(VersionEvent(ENGINE_UPDATE_FAILED, version, url, error=message))
