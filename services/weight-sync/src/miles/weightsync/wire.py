"""Protobuf <-> plain types, and the chunked streams of PublishWeights / FetchWeights / FetchStoredVersion.

A weights stream is one header (every tensor of the version), chunks, one commit. FetchWeights may split a
version over `num_shards` concurrent streams: each carries the same header and commit but only the chunks of
its shard's tensors (tensors dealt largest-first to the least-filled shard, the same on both sides), so one
`PublishAssembler` can take the chunks of all streams and check the whole version at the end.

Fast path: the chunk messages of FetchWeights are encoded and decoded here by hand (`encode_chunk`,
`decode_chunk`) — the same protobuf wire bytes as `PublishWeightsChunk{chunk}`, so any gRPC client can read
them — because going through the protobuf runtime costs two extra copies of every payload byte and made the
stream several times slower than a raw socket. Anything that is not a plain chunk is parsed by protobuf.
"""

from __future__ import annotations

import asyncio
import heapq
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence

from miles.proto.weightsync.v1 import weightsync_pb2 as pb
from miles.weightsync.errors import InvalidPublishError
from miles.weightsync.manifest import TensorBytes, TensorSpec, manifest_digest
from miles.weightsync.publish import PublishAssembler, PublishedVersion, PublishMeta


def spec_to_pb(spec: TensorSpec) -> pb.TensorSpec:
    return pb.TensorSpec(name=spec.name, dtype=spec.dtype, shape=list(spec.shape), sha256=spec.sha256)


def spec_from_pb(message: pb.TensorSpec) -> TensorSpec:
    return TensorSpec(message.name, message.dtype, tuple(int(d) for d in message.shape), message.sha256)


def shard_assignment(specs: Sequence[TensorSpec], num_shards: int) -> list[int]:
    """The shard of each tensor: largest first onto the shard with the fewest bytes so far (ties: lower index)."""
    shards = [(0, index) for index in range(max(1, num_shards))]
    assignment = [0] * len(specs)
    for tensor_index in sorted(range(len(specs)), key=lambda i: (-specs[i].num_bytes, i)):
        filled, shard = heapq.heappop(shards)
        assignment[tensor_index] = shard
        heapq.heappush(shards, (filled + specs[tensor_index].num_bytes, shard))
    return assignment


def header_message(
    job_id: str, version: int, parent_version: int, specs: Sequence[TensorSpec]
) -> pb.PublishWeightsChunk:
    header = pb.PublishHeader(
        job_id=job_id, version=version, parent_version=parent_version, tensors=[spec_to_pb(s) for s in specs]
    )
    return pb.PublishWeightsChunk(header=header)


def meta_from_pb(header: pb.PublishHeader) -> PublishMeta:
    """The scalar fields of a PublishHeader."""
    restored = header.restored_from_version if header.HasField("restored_from_version") else None
    return PublishMeta(
        job_id=header.job_id,
        version=header.version,
        parent_version=header.parent_version,
        step_finished_unix_ms=header.step_finished_unix_ms,
        restored_from_version=restored,
    )


def commit_message(specs: Sequence[TensorSpec]) -> pb.PublishWeightsChunk:
    return pb.PublishWeightsChunk(commit=pb.PublishCommit(manifest_sha256=manifest_digest([s.sha256 for s in specs])))


def _shard_pieces(
    specs: Sequence[TensorSpec], data: Mapping[str, TensorBytes], chunk_bytes: int, shard_index: int, num_shards: int
) -> Iterator[tuple[int, int, memoryview]]:
    assignment = shard_assignment(specs, num_shards)
    for index, spec in enumerate(specs):
        if assignment[index] != shard_index:
            continue
        raw = memoryview(data[spec.name])
        for offset in range(0, len(raw), chunk_bytes):
            yield index, offset, raw[offset : offset + chunk_bytes]


def weights_chunks(
    job_id: str,
    version: int,
    parent_version: int,
    specs: Sequence[TensorSpec],
    data: Mapping[str, TensorBytes],
    chunk_bytes: int,
    *,
    shard_index: int = 0,
    num_shards: int = 1,
) -> Iterator[pb.PublishWeightsChunk]:
    """Header, the chunks of this shard's tensors, commit — as protobuf messages."""
    yield header_message(job_id, version, parent_version, specs)
    for index, offset, piece in _shard_pieces(specs, data, chunk_bytes, shard_index, num_shards):
        yield pb.PublishWeightsChunk(chunk=pb.TensorChunk(tensor_index=index, offset=offset, data=bytes(piece)))
    yield commit_message(specs)


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        low, value = value & 0x7F, value >> 7
        if not value:
            out.append(low)
            return bytes(out)
        out.append(low | 0x80)


def encode_chunk(tensor_index: int, offset: int, data: bytes | memoryview) -> bytes:
    """The wire bytes of PublishWeightsChunk{chunk: TensorChunk{tensor_index, offset, data}} (one copy of data)."""
    inner = b"\x08" + _varint(tensor_index) + b"\x10" + _varint(offset) + b"\x1a" + _varint(len(data))
    return b"".join((b"\x12", _varint(len(inner) + len(data)), inner, data))


def _read_varint(raw: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = raw[pos]
        value |= (byte & 0x7F) << shift
        pos += 1
        if byte < 0x80:
            return value, pos
        shift += 7
        if shift > 63:
            raise ValueError("varint too long")


def decode_chunk(raw: bytes) -> tuple[int, int, memoryview] | None:
    """(tensor_index, offset, data) of a message that is exactly one chunk; None for anything else."""
    try:
        if not raw or raw[0] != 0x12:
            return None
        length, pos = _read_varint(raw, 1)
        if pos + length != len(raw):
            return None
        index = offset = 0
        data = memoryview(b"")
        while pos < len(raw):
            tag, pos = _read_varint(raw, pos)
            if tag == 0x08:
                index, pos = _read_varint(raw, pos)
            elif tag == 0x10:
                offset, pos = _read_varint(raw, pos)
            elif tag == 0x1A:
                size, pos = _read_varint(raw, pos)
                data = memoryview(raw)[pos : pos + size]
                pos += size
            else:
                return None
        return (index, offset, data) if pos == len(raw) else None
    except (IndexError, ValueError):
        return None


def serialize_weights_message(message: pb.PublishWeightsChunk | bytes) -> bytes:
    """Response serializer of FetchWeights: pre-encoded chunks pass through, other messages via protobuf."""
    return message if isinstance(message, bytes) else message.SerializeToString()


def encoded_weights_chunks(
    job_id: str,
    version: int,
    parent_version: int,
    specs: Sequence[TensorSpec],
    data: Mapping[str, TensorBytes],
    chunk_bytes: int,
    *,
    shard_index: int = 0,
    num_shards: int = 1,
) -> Iterator[pb.PublishWeightsChunk | bytes]:
    """As weights_chunks, with the chunks already encoded (encode_chunk): what FetchWeights sends."""
    yield header_message(job_id, version, parent_version, specs)
    for index, offset, piece in _shard_pieces(specs, data, chunk_bytes, shard_index, num_shards):
        yield encode_chunk(index, offset, piece)
    yield commit_message(specs)


class TensorChecks:
    """Hash each tensor in a worker thread as soon as it is complete, overlapping with receiving the rest."""

    def __init__(self, assembler: PublishAssembler) -> None:
        self.assembler = assembler
        self._tasks: list[asyncio.Future[None]] = []

    def add_chunk(self, tensor_index: int, offset: int, data: bytes | memoryview) -> None:
        if self.assembler.add_chunk(tensor_index, offset, data):
            self._tasks.append(asyncio.ensure_future(asyncio.to_thread(self.assembler.check_tensor, tensor_index)))

    async def commit(self, manifest_sha256: str) -> PublishedVersion:
        try:
            await asyncio.gather(*self._tasks)
        except BaseException:
            for task in self._tasks:
                task.cancel()
            raise
        return self.assembler.commit(manifest_sha256)


async def receive_weights(streams: Sequence[AsyncIterator[pb.PublishWeightsChunk | bytes]]) -> PublishedVersion:
    """Assemble one version from one or more shard streams; checks completeness and every checksum."""
    checks: TensorChecks | None = None
    commits: set[str] = set()

    async def drain(stream: AsyncIterator[pb.PublishWeightsChunk | bytes]) -> None:
        nonlocal checks
        async for item in stream:
            if isinstance(item, bytes):
                fast = decode_chunk(item)
                if fast is not None and checks is not None:
                    checks.add_chunk(*fast)
                    continue
                message = pb.PublishWeightsChunk.FromString(item)
            else:
                message = item
            kind = message.WhichOneof("payload")
            if kind == "header":
                header = message.header
                specs = [spec_from_pb(t) for t in header.tensors]
                if checks is None:
                    meta = PublishMeta(header.job_id, header.version, header.parent_version)
                    checks = TensorChecks(PublishAssembler(meta, specs))
                elif tuple(specs) != checks.assembler.specs:
                    raise InvalidPublishError("shard streams disagree on the version's tensors", field="header")
            elif kind == "chunk" and checks is not None:
                checks.add_chunk(message.chunk.tensor_index, message.chunk.offset, message.chunk.data)
            elif kind == "commit":
                commits.add(message.commit.manifest_sha256)
            else:
                raise InvalidPublishError(f"unexpected {kind} message in a weights stream", field="payload")

    tasks = [asyncio.ensure_future(drain(stream)) for stream in streams]
    try:
        await asyncio.gather(*tasks)
    except BaseException:
        for task in tasks:
            task.cancel()
        raise
    if checks is None or len(commits) != 1:
        raise InvalidPublishError("weights stream ended without a header and one commit (truncated)", field="commit")
    return await checks.commit(commits.pop())
