"""Coordination pieces without engines: peer discovery, an unreachable or hung peer reported (never skipped, never
waited on for good), the event log's replay-then-follow, and settings that cannot work refused at start-up."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import pytest

from miles.common.errors import ConfigError
from miles.common.settings import load_settings
from miles.common.telemetry import Metrics
from miles.common.testing import free_port
from miles.proto.weightsync.v1 import weightsync_pb2_grpc as pb_grpc
from miles.weightsync.engines import LocalEngines
from miles.weightsync.events import ENGINE_UPDATED, STORED, EventLog, VersionEvent
from miles.weightsync.metrics import WeightsyncMetrics
from miles.weightsync.rollout import Peers, RolloutPlan, RolloutRunner
from miles.weightsync.settings import WeightsyncSettings


def test_peers_dns_resolves_every_address_and_skips_this_daemon() -> None:
    port = free_port()
    found = Peers(["10.0.0.9:1"], f"localhost:{port}", own_port=port + 1).addresses()
    assert found[0] == "10.0.0.9:1" and f"127.0.0.1:{port}" in found
    assert Peers([], f"localhost:{port}", own_port=port).addresses() == []


async def test_unreachable_peer_is_reported_as_failed() -> None:
    metrics = WeightsyncMetrics(Metrics("weightsync"))
    events = EventLog(10)
    address = f"127.0.0.1:{free_port()}"
    local = LocalEngines([], router=None, metrics=metrics, events=events, request_timeout_s=5)
    runner = RolloutRunner(
        "job", local, Peers([address], "", 0), lambda name: pytest.fail("no local engine"), events, metrics
    )
    outcomes = await runner.run(RolloutPlan(3, "delta", "abort", 1, 10.0))
    await runner.peers.close()
    assert len(outcomes) == 1 and outcomes[0].update_failed and outcomes[0].daemon == address
    assert address in outcomes[0].error


class _HungPeer(pb_grpc.WeightSyncServiceServicer):  # type: ignore[misc]
    """A daemon that takes calls and never answers (stopped with SIGSTOP, or stuck): its connection is up."""

    async def GetVersion(self, request: Any, context: Any) -> Any:
        await asyncio.Event().wait()


async def test_a_peer_that_never_answers_is_reported_failed_after_peer_timeout_s() -> None:
    server = grpc.aio.server()
    pb_grpc.add_WeightSyncServiceServicer_to_server(_HungPeer(), server)  # type: ignore[no-untyped-call]
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    address = f"127.0.0.1:{port}"
    metrics = WeightsyncMetrics(Metrics("weightsync"))
    events = EventLog(10)
    local = LocalEngines([], router=None, metrics=metrics, events=events, request_timeout_s=5)
    peers = Peers([address], "", 0, timeout_s=0.5)
    runner = RolloutRunner("job", local, peers, lambda name: pytest.fail("no local engine"), events, metrics)
    try:
        outcomes = await asyncio.wait_for(runner.run(RolloutPlan(3, "delta", "abort", 1, 10.0)), 60)  # hang guard
    finally:
        await peers.close()
        await server.stop(0)
    assert len(outcomes) == 1 and outcomes[0].update_failed and outcomes[0].daemon == address
    assert "Deadline Exceeded" in outcomes[0].error or "DEADLINE_EXCEEDED" in outcomes[0].error


async def test_event_log_replays_from_a_version_then_follows() -> None:
    log = EventLog(100)
    await log.emit(VersionEvent(STORED, 1))
    await log.emit(VersionEvent(STORED, 2))
    seen: list[tuple[str, int]] = []

    async def watch() -> None:
        async for event in log.watch(from_version=2):
            seen.append((event.kind, event.version))
            if len(seen) == 2:
                return

    watcher = asyncio.create_task(watch())
    await asyncio.sleep(0.05)
    await log.emit(VersionEvent(ENGINE_UPDATED, 2, "http://e"))
    await asyncio.wait_for(watcher, 5)
    assert seen == [(STORED, 2), (ENGINE_UPDATED, 2)]


def test_settings_that_cannot_work_are_refused() -> None:
    with pytest.raises(ConfigError, match="router_url"):
        load_settings(WeightsyncSettings, engine_urls=["http://127.0.0.1:1"], pause_mode="drain")
    with pytest.raises(ConfigError, match="model_config_dir"):
        load_settings(WeightsyncSettings, transport="disk")
    assert (
        load_settings(WeightsyncSettings, engine_urls=["http://127.0.0.1:1"], pause_mode="retract").pause_mode
        == "retract"
    )
