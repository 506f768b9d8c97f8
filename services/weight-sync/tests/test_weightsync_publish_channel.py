"""Publishing over the data channel (OpenPublishChannel + raw TCP + CommitPublish) against an in-process origin core
behind a real gRPC server: round trips over one and three connections, already stored versions sent nothing,
fallbacks to PublishWeights, and every broken transfer or bad commit refused with its field, the store untouched."""

from __future__ import annotations

import asyncio
import hashlib
import random
import socket
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import grpc
import pytest
import torch

from miles.common.errors import FailedPreconditionError, InvalidArgumentError, MilesError, NotFoundError
from miles.common.grpc_client import error_from_rpc_error
from miles.common.grpc_server import GrpcServer, build_grpc_server
from miles.common.settings import load_settings
from miles.common.telemetry import Metrics
from miles.common.testing import free_port
from miles.proto.weightsync.v1 import weightsync_pb2 as pb
from miles.proto.weightsync.v1 import weightsync_pb2_grpc as pb_grpc
from miles.weightsync import publish_sender
from miles.weightsync.client import WeightSyncClient, tensor_bytes
from miles.weightsync.core import WeightSyncCore
from miles.weightsync.daemon_client import DaemonClient
from miles.weightsync.datachannel import ACK, DONE, HELLO, PUBLISH_MAGIC, connection_tensors
from miles.weightsync.errors import DataChannelError
from miles.weightsync.grpc_api import SERVICE_NAME, WeightSyncServicer, add_servicer
from miles.weightsync.manifest import TensorSpec, manifest_digest
from miles.weightsync.settings import WeightsyncSettings
from miles.weightsync.wire import spec_to_pb

pytestmark = pytest.mark.integration
JOB = "job-pc"


@asynccontextmanager
async def origin(**overrides: Any) -> AsyncIterator[tuple[WeightSyncCore, str]]:
    """An origin core with an empty memory:// store, served over gRPC on a free port."""
    settings = load_settings(
        WeightsyncSettings,
        job_id=JOB,
        store_url=f"memory://ws-pc-{uuid.uuid4().hex}",
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
    try:
        yield core, f"127.0.0.1:{server.port}"
    finally:
        await server.stop(0)
        await core.close()


def model_state(seed: int) -> dict[str, torch.Tensor]:
    """Tensors of uneven sizes (one empty), so that three connections carry different shares."""
    generator = torch.Generator().manual_seed(seed)
    return {
        "model.embed_tokens.weight": torch.randn(300, 64, generator=generator),
        "model.layers.0.mlp.up_proj.weight": torch.randn(96, 64, generator=generator),
        "model.norm.weight": torch.randn(64, generator=generator),
        "model.empty.bias": torch.ones(0),
    }


def raw_version(seed: int) -> tuple[list[TensorSpec], dict[str, bytes]]:
    generator = random.Random(seed)
    sizes = {"embed.weight": 300_000, "layer.0.weight": 70_000, "layer.1.weight": 4_098, "empty.bias": 0}
    data = {name: generator.randbytes(size) for name, size in sizes.items()}
    specs = [TensorSpec(n, "bfloat16", (len(raw) // 2,), hashlib.sha256(raw).hexdigest()) for n, raw in data.items()]
    return specs, data


def header(specs: list[TensorSpec], version: int = 0, job_id: str = JOB) -> pb.PublishHeader:
    return pb.PublishHeader(
        job_id=job_id, version=version, parent_version=version - 1, tensors=[spec_to_pb(s) for s in specs]
    )


def payloads(specs: list[TensorSpec], data: dict[str, bytes], num_connections: int) -> list[bytes]:
    """What each connection carries: its tensors' bytes back to back, in header order."""
    return [b"".join(data[specs[i].name] for i in indexes) for indexes in connection_tensors(specs, num_connections)]


async def call(address: str, method: str, request: Any) -> Any:
    """One RPC; a failure raises the MilesError it stands for."""
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.WeightSyncServiceStub(channel)  # type: ignore[no-untyped-call]
        try:
            return await getattr(stub, method)(request)
        except grpc.aio.AioRpcError as exc:
            raise error_from_rpc_error(exc) from exc


async def open_channel(address: str, specs: list[TensorSpec], num_connections: int, version: int = 0) -> Any:
    request = pb.OpenPublishChannelRequest(header=header(specs, version), num_connections=num_connections)
    return await call(address, "OpenPublishChannel", request)


async def commit(address: str, publish_id: str, specs: list[TensorSpec], digest: str | None = None) -> Any:
    digest = digest or manifest_digest([spec.sha256 for spec in specs])
    request = pb.CommitPublishRequest(job_id=JOB, publish_id=publish_id, manifest_sha256=digest)
    return (await call(address, "CommitPublish", request)).stored


def push(port: int, token: bytes, index: int, payload: bytes | None) -> bytes:
    """One connection: hello, then (after the ACK) `payload` and shutdown; everything the daemon answered."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as connection:
        connection.sendall(HELLO.pack(PUBLISH_MAGIC, token, index))
        answer = connection.recv(1)
        if answer == ACK and payload is not None:
            try:
                connection.sendall(payload)
                connection.shutdown(socket.SHUT_WR)
            except OSError:
                return answer
        try:
            while piece := connection.recv(1 << 16):
                answer += piece
        except OSError:  # reset: the daemon closed with our extra bytes unread
            pass
    return answer


def claim_twice(port: int, token: bytes) -> tuple[bytes, bytes, bytes]:
    """Connection 0, then connection 0 again: what each got, and what the first one got after the second."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as first:
        first.sendall(HELLO.pack(PUBLISH_MAGIC, token, 0))
        acked = first.recv(1)
        again = push(port, token, 0, b"")
        return acked, again, first.recv(1)  # the publish failed: the first connection is shut down too


def stored_files(core: WeightSyncCore) -> list[str]:
    return sorted(str(p) for p in core.store.fs.find(core.store.root)) if core.store.fs.exists(core.store.root) else []


def accepted_connections(core: WeightSyncCore) -> float:
    return float(core.metrics.data_connections.labels("accepted")._value.get())


def published_bytes(core: WeightSyncCore, path: str) -> float:
    return float(core.metrics.published_bytes.labels(path)._value.get())


async def test_publish_over_one_and_three_connections_is_bit_exact_on_fetch() -> None:
    states = [model_state(0), model_state(1)]
    async with origin() as (core, address):
        for version, num_connections in enumerate((1, 3)):
            async with WeightSyncClient(address, data_connections=num_connections) as client:
                result = await client.publish(JOB, version, version - 1, states[version])
            assert result.path == "data_channel" and not result.already_stored and result.version == version
        assert accepted_connections(core) == 1 + 3
        expected = [{n: tensor_bytes(t, torch.bfloat16).tobytes() for n, t in state.items()} for state in states]
        assert published_bytes(core, "data_channel") == sum(len(raw) for e in expected for raw in e.values())
        assert published_bytes(core, "grpc") == 0
        fetcher = DaemonClient(address)
        for version in (0, 1):
            fetched, path = await fetcher.fetch_full(
                JOB, version, num_connections=2, chunk_bytes=4096, data_timeout_s=10.0
            )
            assert path == "data_channel"  # the same listener serves both directions
            assert {n: bytes(raw) for n, raw in fetched.data.items()} == expected[version]
        await fetcher.close()
        assert (await core.status()).stored_versions == [0, 1]


async def test_republishing_a_stored_version_answers_already_stored_without_a_transfer() -> None:
    state = model_state(2)
    async with origin() as (core, address), WeightSyncClient(address) as client:
        first = await client.publish(JOB, 0, -1, state)
        before = (accepted_connections(core), published_bytes(core, "data_channel"), stored_files(core))
        again = await client.publish(JOB, 0, -1, state)
        assert again.already_stored and again.path == "already_stored"
        assert again.manifest_sha256 == first.manifest_sha256
        assert (accepted_connections(core), published_bytes(core, "data_channel"), stored_files(core)) == before
        assert core.metrics.publishes.labels("already_stored")._value.get() == 1


async def test_falls_back_to_publish_weights_when_no_channel_can_be_set_up() -> None:
    state = model_state(3)
    async with origin(data_channel=False) as (core, address), WeightSyncClient(address) as client:
        result = await client.publish(JOB, 0, -1, state)  # FAILED_PRECONDITION: the data channel is off
        assert result.path == "grpc" and published_bytes(core, "grpc") == result.full_bytes
    async with origin() as (core, address):
        async with WeightSyncClient(address, data_channel=False) as client:  # the client does not ask
            assert (await client.publish(JOB, 0, -1, state)).path == "grpc"
        assert core.data_server is not None
        core.data_server.port = free_port()  # offers point where nothing listens: connection refused
        async with WeightSyncClient(address) as client:
            assert (await client.publish(JOB, 1, 0, state)).path == "grpc"
            core.data_server.port = core.data_server._listener.getsockname()[1]  # type: ignore[union-attr]
            assert (await client.publish(JOB, 2, 1, state)).path == "grpc"  # not retried for a while
    async with origin() as (core, address), WeightSyncClient(address) as client:
        assert core.data_server is not None
        core.data_server._handlers[PUBLISH_MAGIC] = lambda token, index: None  # refuses every token
        assert (await client.publish(JOB, 0, -1, state)).path == "grpc"
        assert accepted_connections(core) == 0


async def test_falls_back_to_publish_weights_on_a_daemon_that_predates_the_channel() -> None:
    async with origin() as (core, _):
        servicer = WeightSyncServicer(core)
        server = grpc.aio.server()
        only_publish = {
            "PublishWeights": grpc.stream_unary_rpc_method_handler(
                servicer.PublishWeights,
                request_deserializer=pb.PublishWeightsChunk.FromString,
                response_serializer=pb.PublishWeightsResponse.SerializeToString,
            )
        }
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, only_publish),))
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        async with WeightSyncClient(f"127.0.0.1:{port}") as client:
            assert (await client.publish(JOB, 0, -1, model_state(4))).path == "grpc"  # UNIMPLEMENTED
        await server.stop(0)


def _truncate(raw: bytes) -> bytes:
    return raw[:-1]


def _extend(raw: bytes) -> bytes:
    return raw + b"x"


def _flip(raw: bytes) -> bytes:
    return raw[:7] + bytes([raw[7] ^ 1]) + raw[8:]


@pytest.mark.parametrize(
    ("change", "confirmed", "field", "message"),
    [
        (_truncate, False, "commit", "truncated"),
        (_extend, False, "commit", "more bytes"),
        (_flip, True, "header.tensors[0].sha256", "does not match its sha256"),
    ],
)
async def test_broken_transfers_are_refused_and_store_nothing(
    change: Callable[[bytes], bytes], confirmed: bool, field: str, message: str
) -> None:
    specs, data = raw_version(0)
    async with origin() as (core, address):
        offer = await open_channel(address, specs, 1)
        assert offer.num_connections == 1 and len(offer.token) == 32 and offer.publish_id
        answer = await asyncio.to_thread(push, offer.port, offer.token, 0, change(payloads(specs, data, 1)[0]))
        assert answer == (ACK + DONE if confirmed else ACK)
        with pytest.raises(InvalidArgumentError, match=message) as caught:
            await commit(address, offer.publish_id, specs)
        assert caught.value.field == field
        assert stored_files(core) == [] and core.provider.head is None
        assert core.metrics.publishes.labels("rejected")._value.get() == 1


async def test_wrong_manifest_sha256_is_refused_and_the_publish_is_gone() -> None:
    specs, data = raw_version(1)
    async with origin() as (core, address):
        offer = await open_channel(address, specs, 3)
        assert offer.num_connections == 3
        parts = payloads(specs, data, 3)
        answers = await asyncio.gather(
            *(asyncio.to_thread(push, offer.port, offer.token, i, parts[i]) for i in range(3))
        )
        assert answers == [ACK + DONE] * 3
        with pytest.raises(InvalidArgumentError) as caught:
            await commit(address, offer.publish_id, specs, digest="0" * 64)
        assert caught.value.field == "manifest_sha256"
        with pytest.raises(NotFoundError) as gone:  # one commit per publish, right or wrong
            await commit(address, offer.publish_id, specs)
        assert gone.value.field == "publish_id"
        assert stored_files(core) == []


async def test_wrong_token_repeated_index_and_expired_offer_fail_the_publish() -> None:
    specs, data = raw_version(2)
    async with origin(data_timeout_s=1.0) as (core, address):
        offer = await open_channel(address, specs, 1)
        wrong = bytes([offer.token[0] ^ 1]) + offer.token[1:]
        assert await asyncio.to_thread(push, offer.port, wrong, 0, payloads(specs, data, 1)[0]) == b""
        with pytest.raises(InvalidArgumentError, match=r"connections \[0\] did not arrive") as caught:
            await commit(address, offer.publish_id, specs)  # waits at most data_timeout_s
        assert caught.value.field == "commit"

        offer = await open_channel(address, specs, 2)
        assert await asyncio.to_thread(claim_twice, offer.port, offer.token) == (ACK, b"", b"")
        with pytest.raises(InvalidArgumentError, match="connected twice") as caught:
            await commit(address, offer.publish_id, specs)
        assert caught.value.field == "commit"

        offer = await open_channel(address, specs, 1)
        await asyncio.sleep(1.3)  # the offer expires unconnected
        assert await asyncio.to_thread(push, offer.port, offer.token, 0, payloads(specs, data, 1)[0]) == b""
        with pytest.raises(NotFoundError) as expired:
            await commit(address, offer.publish_id, specs)
        assert expired.value.field == "publish_id"
        assert stored_files(core) == [] and core.provider.head is None


async def test_unknown_publish_id_and_other_job_are_not_found() -> None:
    specs, _ = raw_version(3)
    async with origin() as (_, address):
        with pytest.raises(NotFoundError) as unknown:
            await commit(address, "f" * 32, specs)
        assert unknown.value.field == "publish_id"
        with pytest.raises(NotFoundError) as other_job:
            await call(address, "CommitPublish", pb.CommitPublishRequest(job_id="other", publish_id="x"))
        assert other_job.value.field == "job_id"
        with pytest.raises(NotFoundError) as other_header:
            await call(address, "OpenPublishChannel", pb.OpenPublishChannelRequest(header=header(specs, 0, "other")))
        assert other_header.value.field == "job_id"


async def test_wrong_parent_and_version_gap_are_refused_before_any_transfer() -> None:
    state = model_state(5)
    async with origin() as (core, address), WeightSyncClient(address) as client:
        await client.publish(JOB, 0, -1, state)
        before = (accepted_connections(core), published_bytes(core, "data_channel"), stored_files(core))
        with pytest.raises(FailedPreconditionError, match="a gap") as parent:
            await client.publish(JOB, 2, 1, state)
        assert parent.value.field == "header.parent_version"
        with pytest.raises(InvalidArgumentError, match="parent_version \\+ 1") as gap:
            await client.publish(JOB, 3, 1, state)
        assert gap.value.field == "header.version"
        with pytest.raises(FailedPreconditionError, match="other weights") as taken:
            await client.publish(JOB, 0, -1, model_state(6))
        assert taken.value.field == "header.version"
        assert (accepted_connections(core), published_bytes(core, "data_channel"), stored_files(core)) == before
        assert published_bytes(core, "grpc") == 0  # no fallback sent the tensors either
        assert core.metrics.publishes.labels("rejected")._value.get() == 3


async def test_concurrent_offers_for_one_version_the_first_commit_wins() -> None:
    specs, data = raw_version(4)
    other_specs, other_data = raw_version(5)
    async with origin() as (core, address):
        offers = [await open_channel(address, s, 1) for s in (specs, specs, other_specs)]
        for offer, (s, d) in zip(offers, [(specs, data), (specs, data), (other_specs, other_data)], strict=True):
            assert await asyncio.to_thread(push, offer.port, offer.token, 0, payloads(s, d, 1)[0]) == ACK + DONE
        first = await commit(address, offers[0].publish_id, specs)
        same = await commit(address, offers[1].publish_id, specs)  # the same content: idempotent
        assert not first.already_stored and same.already_stored
        assert same.version.manifest_sha256 == first.version.manifest_sha256
        with pytest.raises(FailedPreconditionError, match="other weights") as taken:
            await commit(address, offers[2].publish_id, other_specs)
        assert taken.value.field == "header.version"
        assert (await core.status()).stored_versions == [0]


async def test_a_transfer_broken_after_the_ack_is_an_error_not_a_fallback(monkeypatch: pytest.MonkeyPatch) -> None:
    def send_half(self: publish_sender.PublishSender, index: int, connection: socket.socket, buffer: Any) -> None:
        with buffer(self.tensors[index][0]) as view:
            connection.sendall(view[: len(view) // 2])
        connection.shutdown(socket.SHUT_WR)
        if connection.recv(1) != DONE:
            raise DataChannelError("no DONE")

    monkeypatch.setattr(publish_sender.PublishSender, "_send_connection", send_half)
    async with origin() as (core, address), WeightSyncClient(address) as client:
        with pytest.raises(DataChannelError, match="truncated") as caught:
            await client.publish(JOB, 0, -1, model_state(7))
        assert isinstance(caught.value, MilesError) and caught.value.field == "commit"
        assert stored_files(core) == [] and published_bytes(core, "grpc") == 0
