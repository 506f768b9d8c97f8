"""Rolling a version out to every engine of the job, at most `max_engines_updating` at once.

The daemon that runs a rollout (the origin, in the usual topology) updates its own engines directly and the
engines of its peers — the daemons next to the other engines (sidecars or per-node daemons) — by calling their
UpdateEngines for one engine at a time, so the bound holds across the whole job while every load happens next
to its engine. Peers come from `peers` and from resolving `peers_dns` (a headless Service) at each rollout.

One rollout runs at a time per daemon; each engine's update is independent (engines.py): one failing leaves
that engine drained and reported and the rollout continues with the others. Afterwards the engine version skew
(newest - oldest version served) is recorded.

Peers are asked at once, each GetVersion with a deadline of `timeout_s` (peer_timeout_s), and an UpdateEngines on
a peer gets the per-engine timeout plus `timeout_s`: a peer that hangs (stopped, partitioned) is reported as failed
after that, never waited on for good. Limits: a peer's update legitimately runs up to the per-engine timeout, so a
peer that hangs in the middle of one holds its slot of `max_engines_updating` that long.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass

from miles.common.errors import MilesError
from miles.proto.weightsync.v1 import weightsync_pb2 as pb
from miles.weightsync.daemon_client import DaemonClient
from miles.weightsync.engines import EngineOutcome, LocalEngines
from miles.weightsync.events import (
    ENGINE_UPDATE_FAILED,
    ENGINE_UPDATED,
    ROLLOUT_COMPLETE,
    EventLog,
    VersionEvent,
)
from miles.weightsync.metrics import WeightsyncMetrics
from miles.weightsync.transports import WeightTransport

log = logging.getLogger(__name__)
TRANSPORT_TO_PB = {
    "disk": pb.TRANSPORT_DISK,
    "delta": pb.TRANSPORT_DELTA,
    "stream": pb.TRANSPORT_STREAM,
    "nccl": pb.TRANSPORT_NCCL,
}
PAUSE_TO_PB = {
    "drain": pb.PAUSE_MODE_DRAIN,
    "abort": pb.PAUSE_MODE_ABORT,
    "retract": pb.PAUSE_MODE_RETRACT,
    "in_place": pb.PAUSE_MODE_IN_PLACE,
}


@dataclass(frozen=True)
class RolloutPlan:
    version: int
    transport: str
    pause_mode: str
    max_engines_updating: int
    engine_timeout_s: float
    engine_urls: tuple[str, ...] = ()  # empty: every engine
    step_finished_unix_ms: int = 0  # 0: unknown


def outcome_from_pb(message: pb.EngineVersion, daemon: str) -> EngineOutcome:
    return EngineOutcome(
        engine_url=message.engine_url,
        weight_version=message.weight_version,
        update_failed=message.update_failed,
        error=message.error,
        fell_back=message.fell_back,
        update_duration_s=message.update_duration_s,
        daemon=daemon,
        pause_s=message.pause_s,
        transfer_s=message.transfer_s,
        wire_bytes=message.wire_bytes,
        step_to_serving_s=message.step_to_serving_s,
    )


class Peers:
    """The other daemons of the job this daemon coordinates: static addresses plus a DNS name resolved each time.
    Calls to them carry `auth_token` (the job's weight-sync token)."""

    def __init__(
        self, static: list[str], dns: str, own_port: int, *, auth_token: str = "", timeout_s: float = 30.0
    ) -> None:
        """`timeout_s`: deadline of GetVersion, and what UpdateEngines gets beyond the per-engine timeout."""
        self.static = static
        self.dns = dns
        self.own_port = own_port
        self.auth_token = auth_token
        self.timeout_s = timeout_s
        self._clients: dict[str, DaemonClient] = {}

    def addresses(self) -> list[str]:
        found = list(self.static)
        if self.dns:
            host, _, port = self.dns.rpartition(":")
            own = _own_addresses()
            for info in socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM):
                address = str(info[4][0])
                if not (address in own and int(port) == self.own_port):
                    found.append(f"[{address}]:{port}" if ":" in address else f"{address}:{port}")
        return list(dict.fromkeys(found))

    def client(self, address: str) -> DaemonClient:
        if address not in self._clients:
            self._clients[address] = DaemonClient(address, auth_token=self.auth_token)
        return self._clients[address]

    async def engines(self, job_id: str) -> tuple[list[tuple[str, EngineOutcome]], list[EngineOutcome]]:
        """(peer address, engine outcome) for every engine of every reachable peer, and one failed outcome per
        peer that could not be asked (its engines are unknown; reported, never silently skipped)."""
        found: list[tuple[str, EngineOutcome]] = []
        unreachable: list[EngineOutcome] = []
        addresses = self.addresses()
        answers = await asyncio.gather(
            *(self.client(address).get_version(job_id, timeout_s=self.timeout_s) for address in addresses),
            return_exceptions=True,
        )
        for address, answer in zip(addresses, answers, strict=True):
            if isinstance(answer, MilesError):
                log.warning("peer daemon unreachable", extra={"peer": address, "error": answer.message})
                unreachable.append(EngineOutcome("", -1, True, f"peer {address}: {answer.message}", daemon=address))
                continue
            if isinstance(answer, BaseException):
                raise answer
            found += [(address, outcome_from_pb(engine, address)) for engine in answer.engines if not engine.daemon]
        return found, unreachable

    async def close(self) -> None:
        for client in self._clients.values():
            await client.close()


def _own_addresses() -> set[str]:
    try:
        return {str(info[4][0]) for info in socket.getaddrinfo(socket.gethostname(), None)} | {"127.0.0.1", "::1"}
    except OSError:
        return {"127.0.0.1", "::1"}


class RolloutRunner:
    """Runs rollouts over local engines and peers' engines, one rollout at a time."""

    def __init__(
        self,
        job_id: str,
        local: LocalEngines,
        peers: Peers,
        transport_factory: Callable[[str], WeightTransport],
        events: EventLog,
        metrics: WeightsyncMetrics,
    ) -> None:
        self.job_id = job_id
        self.local = local
        self.peers = peers
        self.transport_factory = transport_factory
        self.events = events
        self.metrics = metrics
        self.lock = asyncio.Lock()

    async def run(self, plan: RolloutPlan) -> list[EngineOutcome]:
        async with self.lock:
            start_s = time.perf_counter()
            transport = self.transport_factory(plan.transport) if self.local.urls else None
            targets: list[tuple[str, str]] = [(url, "") for url in self.local.urls]
            peer_engines, unreachable = await self.peers.engines(self.job_id)
            targets += [(outcome.engine_url, address) for address, outcome in peer_engines]
            if unreachable:
                self.metrics.failures.labels("peer").inc(len(unreachable))
            if plan.engine_urls:
                wanted = {url.rstrip("/") for url in plan.engine_urls}
                targets = [target for target in targets if target[0] in wanted]
            slots = asyncio.Semaphore(plan.max_engines_updating)

            async def update(url: str, daemon: str) -> EngineOutcome:
                async with slots:
                    if not daemon:
                        assert transport is not None
                        return await self.local.update(
                            url,
                            plan.version,
                            transport,
                            plan.pause_mode,
                            plan.engine_timeout_s,
                            step_finished_unix_ms=plan.step_finished_unix_ms,
                        )
                    outcome = await self._update_on_peer(daemon, url, plan)
                    kind = ENGINE_UPDATE_FAILED if outcome.update_failed else ENGINE_UPDATED
                    await self.events.emit(
                        VersionEvent(
                            kind,
                            plan.version,
                            url,
                            error=outcome.error,
                            fell_back=outcome.fell_back,
                            pause_s=outcome.pause_s,
                            transfer_s=outcome.transfer_s,
                            wire_bytes=outcome.wire_bytes,
                            step_to_serving_s=outcome.step_to_serving_s,
                        )
                    )
                    return outcome

            outcomes = list(await asyncio.gather(*(update(url, daemon) for url, daemon in targets))) + unreachable
            self.metrics.observe_phase("rollout", time.perf_counter() - start_s)
            self._record_skew(outcomes)
            await self.events.emit(VersionEvent(ROLLOUT_COMPLETE, plan.version))
            return outcomes

    async def _update_on_peer(self, daemon: str, url: str, plan: RolloutPlan) -> EngineOutcome:
        request = pb.UpdateEnginesRequest(
            job_id=self.job_id,
            version=plan.version,
            transport=TRANSPORT_TO_PB[plan.transport],
            pause_mode=PAUSE_TO_PB[plan.pause_mode],
            max_engines_updating=1,
            engine_timeout_s=plan.engine_timeout_s,
            engine_urls=[url],
            step_finished_unix_ms=plan.step_finished_unix_ms,
        )
        try:
            timeout_s = plan.engine_timeout_s + self.peers.timeout_s
            response = await self.peers.client(daemon).update_engines(request, timeout_s=timeout_s)
        except MilesError as exc:
            self.metrics.failures.labels("peer").inc()
            return EngineOutcome(url, -1, True, f"peer {daemon}: {exc.message}", daemon=daemon)
        if not response.engines:
            return EngineOutcome(url, -1, True, f"peer {daemon} does not know engine {url}", daemon=daemon)
        return outcome_from_pb(response.engines[0], daemon)

    def _record_skew(self, outcomes: list[EngineOutcome]) -> None:
        versions = [o.weight_version for o in outcomes if o.weight_version >= 0 and not o.update_failed]
        self.metrics.engine_version_skew.set(max(versions) - min(versions) if versions else 0)
