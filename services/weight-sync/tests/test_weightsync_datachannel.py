"""The stream transport's raw TCP data channel (OpenDataChannel + datachannel.py + receive.py) against an
in-process origin core behind a real gRPC server: round trip over one and several connections, tokens refused,
a truncated or corrupted transfer rejected before any engine is touched, and the fallback to FetchWeights."""

from __future__ import annotations

import asyncio
import hashlib
import random
import socket
import threading
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from typing import Any

import grpc
import pytest

from miles.common.grpc_server import GrpcServer, build_grpc_server
from miles.common.settings import load_settings
from miles.common.telemetry import Metrics
from miles.common.testing import free_port
from miles.proto.weightsync.v1 import weightsync_pb2 as pb
from miles.weightsync import datachannel
from miles.weightsync.core import WeightSyncCore
from miles.weightsync.daemon_client import DaemonClient, address_host
from miles.weightsync.datachannel import ACK, HELLO, MAGIC
from miles.weightsync.errors import DataChannelError, DataChannelSetupError, InvalidPublishError
from miles.weightsync.grpc_api import SERVICE_NAME, WeightSyncServicer, add_servicer
from miles.weightsync.manifest import TensorSpec, manifest_digest
from miles.weightsync.metrics import WeightsyncMetrics
from miles.weightsync.provider import WeightProvider
from miles.weightsync.publish import PublishAssembler, PublishMeta
from miles.weightsync.receive import DataChannelReceiver, receive_over_data_channel
from miles.weightsync.settings import WeightsyncSettings
from miles.weightsync.store import VersionStore
from miles.weightsync.transports import StreamTransport

pytestmark = pytest.mark.integration
JOB = "job-dc"


def make_tensors(seed: int) -> tuple[list[TensorSpec], dict[str, bytes]]:
    """Raw bf16-sized tensors of uneven sizes (one empty), so several connections get different shares."""
    generator = random.Random(seed)
    sizes = {"embed.weight": 300_000, "layer.0.weight": 70_000, "layer.1.weight": 4_098, "empty.bias": 0}
    data = {name: generator.randbytes(size) for name, size in sizes.items()}
    specs = [TensorSpec(n, "bfloat16", (len(raw) // 2,), hashlib.sha256(raw).hexdigest()) for n, raw in data.items()]
    return specs, data


@asynccontextmanager
async def origin(**overrides: Any) -> AsyncIterator[tuple[WeightSyncCore, str]]:
    """An origin core with version 0 of make_tensors(0) stored, served over gRPC on a free port."""
    settings = load_settings(
        WeightsyncSettings,
        job_id=JOB,
        store_url=f"memory://ws-dc-{uuid.uuid4().hex}",
        auto_update=False,
        pause_mode="abort",
        **overrides,
    )
    metrics = Metrics("weightsync")
    core = WeightSyncCore(settings, metrics)
    await core.start()
    server: GrpcServer = build_grpc_server(
        servicers=[(add_servicer, WeightSyncServicer(core))], service_names=[SERVICE_NAME], metrics=metrics
    )
    await server.start()
    specs, data = make_tensors(0)
    assembler = await core.intake.begin_publish(PublishMeta(JOB, 0, -1), specs)
    assert isinstance(assembler, PublishAssembler)
    for index, spec in enumerate(specs):
        assembler.add_chunk(index, 0, data[spec.name])
    await core.intake.store_published(assembler.commit(manifest_digest([s.sha256 for s in specs])))
    try:
        yield core, f"127.0.0.1:{server.port}"
    finally:
        await server.stop(0)
        await core.close()


async def fetch(address: str, num_connections: int, timeout_s: float | None = 10.0) -> tuple[dict[str, bytes], str]:
    client = DaemonClient(address)
    try:
        published, path = await client.fetch_full(
            JOB, 0, num_connections=num_connections, chunk_bytes=4096, data_timeout_s=timeout_s
        )
    finally:
        await client.close()
    return {name: bytes(raw) for name, raw in published.data.items()}, path


async def open_offer(address: str, num_connections: int = 1) -> pb.OpenDataChannelResponse:
    async with grpc.aio.insecure_channel(address) as channel:
        call = channel.unary_unary(
            f"/{SERVICE_NAME}/OpenDataChannel",
            request_serializer=pb.OpenDataChannelRequest.SerializeToString,
            response_deserializer=pb.OpenDataChannelResponse.FromString,
        )
        offer: pb.OpenDataChannelResponse = await call(
            pb.OpenDataChannelRequest(job_id=JOB, version=0, num_connections=num_connections)
        )
    return offer


def hello_answer(port: int, token: bytes, index: int) -> bytes:
    """What the daemon sends back to one handshake, until it closes the connection."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as connection:
        connection.sendall(HELLO.pack(MAGIC, token, index))
        received = b""
        while piece := connection.recv(1 << 20):
            received += piece
    return received


async def test_round_trip_over_one_and_several_connections() -> None:
    _, expected = make_tensors(0)
    async with origin() as (core, address):
        for num_connections in (1, 3):
            data, path = await fetch(address, num_connections)
            assert path == "data_channel"
            assert data == expected
        served = core.metrics.served_bytes.labels("data_channel")._value.get()
    assert served == 2 * sum(len(raw) for raw in expected.values())


async def test_wrong_token_replayed_index_and_late_connection_are_refused() -> None:
    async with origin(data_timeout_s=2.0) as (core, address):
        offer = await open_offer(address, num_connections=2)
        assert offer.num_connections == 2 and len(offer.token) == 32
        wrong = bytes([offer.token[0] ^ 1]) + offer.token[1:]
        assert await asyncio.to_thread(hello_answer, offer.port, wrong, 0) == b""
        assert await asyncio.to_thread(hello_answer, offer.port, offer.token, 2) == b""  # index out of range
        first = await asyncio.to_thread(hello_answer, offer.port, offer.token, 0)
        assert first.startswith(ACK) and len(first) > 1
        assert await asyncio.to_thread(hello_answer, offer.port, offer.token, 0) == b""  # served once
        rejected = core.metrics.data_connections.labels("rejected")._value.get()
        assert rejected == 3
        await asyncio.sleep(2.5)  # the offer expires: its last connection is refused too
        assert await asyncio.to_thread(hello_answer, offer.port, offer.token, 1) == b""
        specs = [TensorSpec(t.name, t.dtype, tuple(t.shape), t.sha256) for t in offer.header.tensors]
        receiver = DataChannelReceiver("127.0.0.1", offer.port, wrong, specs, 1, 5.0)
        with pytest.raises(DataChannelSetupError, match="refused"):
            await asyncio.to_thread(receiver.connect)


def serve_once(send: Callable[[socket.socket], None]) -> tuple[int, threading.Thread]:
    """A one-connection data server that answers the handshake with ACK and then runs `send`."""
    listener = socket.create_server(("127.0.0.1", 0))

    def run() -> None:
        connection, _ = listener.accept()
        with connection, listener:
            connection.recv(HELLO.size)
            connection.sendall(ACK)
            send(connection)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return listener.getsockname()[1], thread


@pytest.mark.parametrize(
    ("description", "cut", "error"),
    [
        ("truncated in the first tensor", lambda raw: raw[:1000], DataChannelError),
        ("truncated in the last tensor", lambda raw: raw[:-1], DataChannelError),
        ("extra bytes after the tensors", lambda raw: raw + b"x", DataChannelError),
        ("one flipped byte", lambda raw: raw[:5] + bytes([raw[5] ^ 1]) + raw[6:], InvalidPublishError),
    ],
)
async def test_bad_transfers_are_rejected(description: str, cut: Callable[[bytes], bytes], error: type) -> None:
    specs, data = make_tensors(1)
    raw = b"".join(data[spec.name] for spec in specs)
    port, thread = serve_once(lambda connection: connection.sendall(cut(raw)))
    receiver = DataChannelReceiver("127.0.0.1", port, b"t" * 32, specs, 1, 10.0)
    digest = manifest_digest([spec.sha256 for spec in specs])
    with pytest.raises(error):
        await receive_over_data_channel(receiver, job_id=JOB, version=0, manifest_sha256=digest)
    thread.join(10)


class RecordingEngine:
    """Stands in for an engine client: records what would reach the engine."""

    base_url = "http://engine.invalid"

    def __init__(self) -> None:
        self.loads: list[Sequence[str]] = []

    async def update_weights_from_tensor(self, serialized: list[str], weight_version: str | None) -> None:
        self.loads.append(serialized)


async def test_truncated_transfer_fails_the_load_and_touches_no_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    def truncating_send(connection: socket.socket, views: Sequence[memoryview]) -> None:
        connection.sendall(ACK)
        connection.sendall(views[0][: len(views[0]) // 2])
        connection.shutdown(socket.SHUT_WR)

    async with origin() as (_, address):
        monkeypatch.setattr(datachannel, "_send_all", truncating_send)
        metrics = WeightsyncMetrics(Metrics("weightsync"))
        client = DaemonClient(address)
        provider = WeightProvider(
            VersionStore(f"memory://ws-dc-peer-{uuid.uuid4().hex}", JOB),
            origin=client,
            metrics=metrics,
            fetch_streams=2,
            chunk_bytes=4096,
            retain_versions=5,
            data_timeout_s=10.0,
        )
        engine = RecordingEngine()
        with pytest.raises(DataChannelError, match="truncated"):
            await StreamTransport(provider, 1 << 20).load(engine, 0, None)  # type: ignore[arg-type]
        await client.close()
    assert engine.loads == []
    assert metrics.fetched_bytes._value.get() == 0


async def test_falls_back_to_fetch_weights_when_the_channel_cannot_be_set_up(monkeypatch: pytest.MonkeyPatch) -> None:
    _, expected = make_tensors(0)
    async with origin(data_channel=False) as (_, address):  # the origin offers none: FAILED_PRECONDITION
        assert await fetch(address, 2) == (expected, "grpc")
    async with origin() as (_, address):
        assert await fetch(address, 2, timeout_s=None) == (expected, "grpc")  # the receiver does not ask
    async with origin() as (core, address):
        monkeypatch.setattr(datachannel.DataChannelServer, "_claim", lambda self, hello: None)  # refuses tokens
        client = DaemonClient(address)
        for _ in range(2):  # the second load does not try again (DATA_CHANNEL_RETRY_S)
            published, path = await client.fetch_full(JOB, 0, num_connections=2, chunk_bytes=4096, data_timeout_s=10.0)
            assert path == "fallback" and {n: bytes(raw) for n, raw in published.data.items()} == expected
            assert core.metrics.data_connections.labels("rejected")._value.get() == 2
        await client.close()
    async with origin() as (core, address):
        assert core.data_server is not None
        core.data_server.port = free_port()  # offers point where nothing listens: connection refused
        assert await fetch(address, 1) == (expected, "fallback")


def test_address_host_parses_grpc_targets() -> None:
    assert address_host("10.0.0.7:50053") == "10.0.0.7"
    assert address_host("dns:///weightsync-origin.ns.svc:50053") == "weightsync-origin.ns.svc"
    assert address_host("[::1]:50053") == "::1"
    assert address_host("ipv4:127.0.0.1:1") == "127.0.0.1"
