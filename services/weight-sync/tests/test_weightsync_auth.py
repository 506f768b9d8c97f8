"""Bearer tokens on weight-sync's gRPC API, against an in-process daemon core behind its real server (build_server):
every WeightSyncService method is UNAUTHENTICATED without the token and PERMISSION_DENIED with another, runs with
it (each one really succeeds through the clients), and the probes stay open; a daemon sends the job's token to its
origin and its peers; settings refuse a daemon on the network without a token."""

from __future__ import annotations

import os
import subprocess
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from miles.common.auth import MIN_TOKEN_CHARS
from miles.common.errors import ConfigError, PermissionDeniedError, UnauthenticatedError
from miles.common.grpc_client import create_channel
from miles.common.settings import load_settings
from miles.common.telemetry import Metrics
from miles.common.testing import free_port
from miles.common.testing.smoke import console_script
from miles.proto.weightsync.v1 import weightsync_pb2 as pb
from miles.proto.weightsync.v1 import weightsync_pb2_grpc as pb_grpc
from miles.weightsync.client import WeightSyncClient
from miles.weightsync.core import WeightSyncCore
from miles.weightsync.daemon_client import DaemonClient
from miles.weightsync.grpc_api import build_server
from miles.weightsync.rollout import Peers
from miles.weightsync.settings import WeightsyncSettings

pytestmark = pytest.mark.integration
JOB = "job-auth"
TOKEN = "w" * MIN_TOKEN_CHARS
OTHER = "o" * MIN_TOKEN_CHARS
_HEADER = pb.PublishHeader(job_id=JOB, version=0, parent_version=-1)
# One request per WeightSyncService method: the token is checked before any of them is looked at.
REQUESTS: dict[str, Any] = {
    "PublishWeights": pb.PublishWeightsChunk(header=_HEADER),
    "GetVersion": pb.GetVersionRequest(job_id=JOB),
    "WatchVersions": pb.WatchVersionsRequest(job_id=JOB),
    "UpdateEngines": pb.UpdateEnginesRequest(job_id=JOB, version=0),
    "FetchWeights": pb.FetchWeightsRequest(job_id=JOB, version=0),
    "FetchStoredVersion": pb.FetchStoredVersionRequest(job_id=JOB, version=0),
    "OpenDataChannel": pb.OpenDataChannelRequest(job_id=JOB, version=0, num_connections=1),
    "OpenPublishChannel": pb.OpenPublishChannelRequest(header=_HEADER, num_connections=1),
    "CommitPublish": pb.CommitPublishRequest(job_id=JOB, publish_id="none", manifest_sha256="0" * 64),
}
_STREAMING_RESPONSES = {"WatchVersions", "FetchWeights", "FetchStoredVersion"}


@asynccontextmanager
async def daemon(**overrides: Any) -> AsyncIterator[tuple[WeightSyncCore, str]]:
    """A daemon core (memory:// store, auth_token TOKEN unless overridden) served by its real gRPC server."""
    fields = {"job_id": JOB, "store_url": f"memory://ws-auth-{uuid.uuid4().hex}", "auto_update": False}
    settings = load_settings(WeightsyncSettings, **{**fields, "auth_token": TOKEN, "pause_mode": "abort", **overrides})
    metrics = Metrics("weightsync")
    core = WeightSyncCore(settings, metrics)
    await core.start()
    server = build_server(core, metrics, port=0)
    await server.start()
    try:
        yield core, f"127.0.0.1:{server.port}"
    finally:
        await server.stop(0)
        await core.close()


def weights(seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {
        "embed.weight": torch.randn(64, 16, generator=generator),
        "norm.weight": torch.randn(16, generator=generator),
    }


async def call(address: str, token: str, method: str) -> grpc.StatusCode:
    """One call of `method` carrying `token` ("" = none); the status it ended with."""
    async with create_channel(address, bearer_token=token) as channel:
        rpc = getattr(pb_grpc.WeightSyncServiceStub(channel), method)  # type: ignore[no-untyped-call]
        request = REQUESTS[method]
        try:
            if method == "PublishWeights":
                await rpc(iter([request]))
            elif method in _STREAMING_RESPONSES:
                stream = rpc(request, timeout=2.0)  # WatchVersions without events runs into it: DEADLINE_EXCEEDED
                async for _ in stream:
                    break  # one message (or the error) is enough
                stream.cancel()
            else:
                await rpc(request)
        except grpc.aio.AioRpcError as exc:
            return exc.code()
    return grpc.StatusCode.OK


def test_every_method_of_the_service_is_covered() -> None:
    assert set(REQUESTS) == set(pb.DESCRIPTOR.services_by_name["WeightSyncService"].methods_by_name)


@pytest.mark.parametrize("method", sorted(REQUESTS))
async def test_every_method_needs_the_token(method: str) -> None:
    async with daemon() as (_, address):
        assert await call(address, "", method) == grpc.StatusCode.UNAUTHENTICATED
        assert await call(address, OTHER, method) == grpc.StatusCode.PERMISSION_DENIED
        # With the token the method itself answers (these minimal requests may be refused on their merits).
        assert await call(address, TOKEN, method) not in (
            grpc.StatusCode.UNAUTHENTICATED,
            grpc.StatusCode.PERMISSION_DENIED,
        )


async def test_with_the_token_every_method_works_and_probes_stay_open() -> None:
    async with daemon() as (_, address):
        async with WeightSyncClient(address, auth_token=TOKEN) as client:
            first = await client.publish(JOB, 0, -1, weights(0))  # OpenPublishChannel + CommitPublish
            status = await client.get_version(JOB)
            events = client.watch_versions(JOB)
            event = await anext(events)
            await events.aclose()
            rollout = await client.update_engines(JOB, 0)  # no engines here: nothing to update
            fetched = await client.fetch_weights(JOB, 0)  # FetchWeights
        async with WeightSyncClient(address, auth_token=TOKEN, data_channel=False) as client:
            second = await client.publish(JOB, 1, 0, weights(1))  # PublishWeights
        peer = DaemonClient(address, auth_token=TOKEN)
        full, path = await peer.fetch_full(JOB, 1, num_connections=2, chunk_bytes=1 << 16, data_timeout_s=10.0)
        stored = [message async for message in peer.fetch_stored(JOB, 1, 1 << 16)]
        await peer.close()
        async with create_channel(address) as channel:  # no token: health is a probe
            health = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""))
    assert (first.path, second.path) == ("data_channel", "grpc")
    assert status.latest_version == 0 and event.version == 0 and list(rollout.engines) == []
    assert set(fetched.data) == set(weights(0))
    assert (full.version, path) == (1, "data_channel")
    assert stored and stored[0].WhichOneof("payload") == "manifest_json"
    assert health.status == health_pb2.HealthCheckResponse.SERVING


@pytest.mark.parametrize(
    ("token", "error"), [("", UnauthenticatedError), (OTHER, PermissionDeniedError)], ids=["no_token", "wrong_token"]
)
async def test_the_client_fails_with_a_clear_error_without_the_right_token(token: str, error: type) -> None:
    async with daemon() as (core, address):
        async with WeightSyncClient(address, auth_token=token) as client:
            with pytest.raises(error, match="weight-sync's WeightSyncService"):
                await client.publish(JOB, 0, -1, weights(0))
            with pytest.raises(error):
                await client.get_version(JOB)
        assert core.store.list_versions() == []


async def test_a_daemon_sends_the_jobs_token_to_its_origin_and_peers() -> None:
    async with daemon() as (_, origin_address):
        async with WeightSyncClient(origin_address, auth_token=TOKEN) as client:
            await client.publish(JOB, 0, -1, weights(0))
        async with daemon(origin=origin_address, store_url=f"memory://ws-auth-{uuid.uuid4().hex}") as (peer, address):
            replicated = await peer.full_weights(0)  # FetchStoredVersion + OpenDataChannel at the origin
            found, unreachable = await Peers([address], "", 0, auth_token=TOKEN).engines(JOB)
            _, refused = await Peers([address], "", 0, auth_token=OTHER).engines(JOB)
        async with daemon(origin=origin_address, auth_token=OTHER) as (stranger, _):
            with pytest.raises(PermissionDeniedError):
                await stranger.full_weights(0)
    assert replicated.version == 0 and set(replicated.data) == set(weights(0))
    assert found == [] and unreachable == []  # reachable, no engines
    assert len(refused) == 1 and "not accepted" in refused[0].error


def test_settings_refuse_a_daemon_on_the_network_without_a_token(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ConfigError, match=r"auth_token is required when host is '0\.0\.0\.0'"):
        load_settings(WeightsyncSettings, host="0.0.0.0")
    with pytest.raises(ConfigError, match=f"at least {MIN_TOKEN_CHARS}"):
        load_settings(WeightsyncSettings, auth_token="short")
    assert load_settings(WeightsyncSettings).auth_token.get_secret_value() == ""  # loopback: open (development)
    monkeypatch.setenv("MILES_WEIGHTSYNC_HOST", "0.0.0.0")
    monkeypatch.setenv("MILES_WEIGHTSYNC_AUTH_TOKEN", TOKEN)
    monkeypatch.setenv("MILES_WEIGHTSYNC_ROUTER_ADMIN_TOKEN", "router-admin")
    monkeypatch.setenv("MILES_WEIGHTSYNC_ENGINE_ADMIN_API_KEY", "engine-admin")
    monkeypatch.setenv("MILES_WEIGHTSYNC_ENGINE_API_KEY", "engine-api")
    settings = load_settings(WeightsyncSettings)
    assert settings.auth_token.get_secret_value() == TOKEN
    assert settings.router_admin_token.get_secret_value() == "router-admin"
    assert settings.engine_admin_api_key.get_secret_value() == "engine-admin"
    assert settings.engine_api_key.get_secret_value() == "engine-api"
    assert TOKEN not in repr(settings)  # secrets stay out of logs


def test_a_daemon_process_on_the_network_without_a_token_refuses_to_start() -> None:
    env = {**os.environ, "MILES_WEIGHTSYNC_HOST": "0.0.0.0", "MILES_WEIGHTSYNC_PORT": str(free_port())}
    env.pop("MILES_WEIGHTSYNC_AUTH_TOKEN", None)
    result = subprocess.run(
        [console_script("miles-weight-sync")], env=env, capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode != 0
    assert "auth_token is required when host is '0.0.0.0'" in result.stderr
