"""PublishWeights / FetchWeights / GetVersion over a real gRPC socket to an in-process daemon core (memory://
store): torch tensors in, the same bytes out; every malformed publish rejected with the field named and the
store untouched."""

from __future__ import annotations

import asyncio
import hashlib
import uuid
from collections.abc import AsyncIterator, Iterator

import grpc
import pytest
import torch

from miles.common.errors import FailedPreconditionError, InvalidArgumentError, MilesError, NotFoundError
from miles.common.grpc_client import error_from_rpc_error
from miles.common.grpc_server import GrpcServer, build_grpc_server
from miles.common.settings import load_settings
from miles.common.telemetry import Metrics
from miles.proto.weightsync.v1 import weightsync_pb2 as pb
from miles.weightsync.client import WeightSyncClient, tensor_bytes
from miles.weightsync.core import WeightSyncCore
from miles.weightsync.grpc_api import SERVICE_NAME, WeightSyncServicer, add_servicer
from miles.weightsync.manifest import TensorSpec
from miles.weightsync.publish import PublishAssembler, PublishMeta
from miles.weightsync.settings import WeightsyncSettings
from miles.weightsync.wire import decode_chunk, encode_chunk, weights_chunks

JOB = "job-p"


@pytest.fixture
async def daemon() -> AsyncIterator[tuple[WeightSyncCore, str]]:
    settings = load_settings(
        WeightsyncSettings,
        job_id=JOB,
        store_url=f"memory://ws-publish-{uuid.uuid4().hex}",
        auto_update=False,
        pause_mode="abort",
        snapshot_interval=4,
    )
    metrics = Metrics("weightsync")
    core = WeightSyncCore(settings, metrics)
    server: GrpcServer = build_grpc_server(
        servicers=[(add_servicer, WeightSyncServicer(core))], service_names=[SERVICE_NAME], metrics=metrics
    )
    await server.start()
    yield core, f"127.0.0.1:{server.port}"
    await server.stop(0)
    await core.close()


def model_state(seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {
        "model.embed_tokens.weight": torch.randn(300, 32, generator=generator),
        "model.layers.0.mlp.up_proj.weight": torch.randn(64, 32, generator=generator),
        "model.norm.weight": torch.ones(32),
    }


def stored_files(core: WeightSyncCore) -> list[str]:
    return sorted(str(p) for p in core.store.fs.find(core.store.root)) if core.store.fs.exists(core.store.root) else []


async def test_published_tensors_come_back_bit_exact(daemon: tuple[WeightSyncCore, str]) -> None:
    core, address = daemon
    first, second = model_state(0), model_state(0)
    second["model.layers.0.mlp.up_proj.weight"] += 1e-2
    async with WeightSyncClient(address, chunk_bytes=4096) as client:
        snapshot = await client.publish(JOB, 0, -1, first)
        delta = await client.publish(JOB, 1, 0, second.items())
        assert snapshot.is_snapshot and not delta.is_snapshot
        assert delta.full_bytes == sum(t.numel() * 2 for t in second.values())
        assert delta.stored_bytes < delta.full_bytes
        assert 0 < delta.num_changed_elements <= 64 * 32
        for num_streams in (1, 3):
            fetched = await client.fetch_weights(JOB, 1, num_streams=num_streams)
            assert {n: bytes(raw) for n, raw in fetched.data.items()} == {
                n: tensor_bytes(t, torch.bfloat16).tobytes() for n, t in second.items()
            }
        status = await client.get_version(JOB)
    assert status.latest_version == 1 and list(status.stored_versions) == [0, 1]
    assert core.provider.head is not None and core.provider.head.version == 1


async def _raw_publish(address: str, messages: list[pb.PublishWeightsChunk]) -> None:
    async def requests() -> AsyncIterator[pb.PublishWeightsChunk]:
        for message in messages:
            yield message

    async with grpc.aio.insecure_channel(address) as channel:
        stub = channel.stream_unary(
            f"/{SERVICE_NAME}/PublishWeights",
            request_serializer=pb.PublishWeightsChunk.SerializeToString,
            response_deserializer=pb.PublishWeightsResponse.FromString,
        )
        try:
            await stub(requests())
        except grpc.aio.AioRpcError as exc:
            raise error_from_rpc_error(exc) from exc


def _messages(state: dict[str, torch.Tensor], version: int) -> list[pb.PublishWeightsChunk]:
    data = {name: tensor_bytes(t, torch.bfloat16).tobytes() for name, t in state.items()}
    specs = [TensorSpec(n, "bfloat16", tuple(t.shape), hashlib.sha256(data[n]).hexdigest()) for n, t in state.items()]
    return list(weights_chunks(JOB, version, version - 1, specs, data, 1000))


def _broken_streams(state: dict[str, torch.Tensor]) -> Iterator[tuple[str, list[pb.PublishWeightsChunk], str]]:
    good = _messages(state, 1)
    yield "truncated: no commit", good[:-1], "commit"
    yield "truncated: a tensor cut short", [*good[:3], good[-1]], "header.tensors"
    yield "starts with a chunk", good[1:], "header"
    yield "chunks out of order", [good[0], good[2], good[1], *good[3:]], "chunk.offset"
    bad_commit = pb.PublishWeightsChunk(commit=pb.PublishCommit(manifest_sha256="0" * 64))
    yield "bad commit digest", [*good[:-1], bad_commit], "commit.manifest_sha256"
    flipped = pb.PublishWeightsChunk()
    flipped.CopyFrom(good[1])
    flipped.chunk.data = bytes([flipped.chunk.data[0] ^ 1]) + flipped.chunk.data[1:]
    yield "flipped byte", [good[0], flipped, *good[2:]], "sha256"
    past_end = pb.PublishWeightsChunk(chunk=pb.TensorChunk(tensor_index=2, offset=0, data=b"x" * 65))
    yield "chunk past the tensor", [good[0], past_end], "chunk.data"
    duplicate = pb.PublishWeightsChunk()
    duplicate.CopyFrom(good[0])
    duplicate.header.tensors.append(duplicate.header.tensors[0])
    yield "duplicate tensor name", [duplicate], "name"
    bad_sha = pb.PublishWeightsChunk()
    bad_sha.CopyFrom(good[0])
    bad_sha.header.tensors[0].sha256 = "XYZ"
    yield "malformed sha256", [bad_sha], "sha256"


async def test_malformed_publishes_are_rejected_and_store_untouched(daemon: tuple[WeightSyncCore, str]) -> None:
    core, address = daemon
    state = model_state(0)
    async with WeightSyncClient(address) as client:
        await client.publish(JOB, 0, -1, state)
        before = stored_files(core)
        head = core.provider.head
        with pytest.raises(NotFoundError, match="job"):
            await client.publish("other-job", 1, 0, state)
        with pytest.raises(FailedPreconditionError, match="parent_version"):
            await client.publish(JOB, 2, 1, state)
        with pytest.raises(InvalidArgumentError, match="dtype"):
            await client.publish(JOB, 1, 0, state, dtype="float16")
        with pytest.raises(InvalidArgumentError, match="shape"):
            await client.publish(JOB, 1, 0, {**state, "model.norm.weight": torch.ones(33)})
        with pytest.raises(InvalidArgumentError, match="missing"):
            await client.publish(JOB, 1, 0, {k: v for k, v in state.items() if k != "model.norm.weight"})
        with pytest.raises(InvalidArgumentError, match="not in the parent"):
            await client.publish(JOB, 1, 0, {**state, "extra.weight": torch.ones(2)})
        for description, messages, field in _broken_streams(state):
            with pytest.raises(InvalidArgumentError) as caught:
                await _raw_publish(address, messages)
            assert field in (caught.value.field or "") + caught.value.message, description
        assert stored_files(core) == before
        assert core.provider.head is head
        accepted = await client.publish(JOB, 1, 0, state)  # the parent is still usable
    assert accepted.version == 1 and accepted.num_changed_elements == 0


async def test_fetch_of_unknown_version_is_not_found(daemon: tuple[WeightSyncCore, str]) -> None:
    _, address = daemon
    async with WeightSyncClient(address) as client:
        await client.publish(JOB, 0, -1, model_state(1))
        with pytest.raises(MilesError, match="version 5"):
            await client.fetch_weights(JOB, 5)


def test_hand_encoded_chunks_are_protobuf_wire_compatible() -> None:
    for index, offset, data in [(0, 0, b""), (3, 1 << 20, b"abc"), (70000, 2**40, bytes(300))]:
        message = pb.PublishWeightsChunk(chunk=pb.TensorChunk(tensor_index=index, offset=offset, data=data))
        assert pb.PublishWeightsChunk.FromString(encode_chunk(index, offset, data)) == message
        decoded = decode_chunk(message.SerializeToString())
        assert decoded is not None and decoded[:2] == (index, offset) and bytes(decoded[2]) == data
    header = pb.PublishWeightsChunk(header=pb.PublishHeader(job_id="j"))
    assert decode_chunk(header.SerializeToString()) is None
    assert decode_chunk(b"\x12\x05\x08") is None  # truncated


async def test_auto_update_rolls_out_each_stored_version() -> None:
    settings = load_settings(
        WeightsyncSettings, job_id=JOB, store_url=f"memory://ws-auto-{uuid.uuid4().hex}", pause_mode="abort"
    )
    core = WeightSyncCore(settings, Metrics("weightsync"))
    events: list[tuple[str, int]] = []

    async def watch() -> None:
        async for event in core.watch(0):
            events.append((event.kind, event.version))
            if event.kind == "rollout_complete" and event.version == 1:
                return

    watcher = asyncio.create_task(watch())
    state = model_state(2)
    for version in (0, 1):
        data = {name: tensor_bytes(t, torch.bfloat16).tobytes() for name, t in state.items()}
        specs = [
            TensorSpec(n, "bfloat16", tuple(t.shape), hashlib.sha256(data[n]).hexdigest()) for n, t in state.items()
        ]
        assembler = await core.intake.begin_publish(PublishMeta(JOB, version, version - 1), specs)
        assert isinstance(assembler, PublishAssembler)
        for index, spec in enumerate(specs):
            assembler.add_chunk(index, 0, data[spec.name])
        await core.intake.store_published(assembler.commit(core_digest(specs)))
    await asyncio.wait_for(watcher, 30)
    await core.close()
    assert ("stored", 0) in events and ("stored", 1) in events and events[-1] == ("rollout_complete", 1)


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def core_digest(specs: list[TensorSpec]) -> str:
    from miles.weightsync.manifest import manifest_digest

    return manifest_digest([spec.sha256 for spec in specs])
