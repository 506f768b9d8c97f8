"""Receiving a published version: header validation against the parent, chunk assembly, commit checks.

Nothing here writes anywhere: a `PublishAssembler` only holds bytes in memory until `commit` has checked that
every tensor is complete and matches its sha256 and that the commit's content address is right. So a wrong
parent, a mismatched shape or dtype, a bad chunk, a truncated stream or a bad checksum is rejected before the
store or any engine is touched (the caller stores only what `commit` returns).
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence
from dataclasses import dataclass

from miles.weightsync.errors import InvalidPublishError, WrongParentError
from miles.weightsync.manifest import DTYPE_ITEMSIZE, TensorBytes, TensorSpec, manifest_digest

_SHA256_RE = re.compile(r"^[0-9a-f]{64}$")


@dataclass(frozen=True)
class PublishMeta:
    """What a publish says besides its tensors (PublishHeader's scalar fields)."""

    job_id: str
    version: int
    parent_version: int
    step_finished_unix_ms: int = 0
    restored_from_version: int | None = None


@dataclass(frozen=True)
class PublishedVersion:
    """A complete, checked version as the trainer sent it (raw bytes by name, specs in order)."""

    job_id: str
    version: int
    parent_version: int
    specs: tuple[TensorSpec, ...]
    data: dict[str, TensorBytes]
    step_finished_unix_ms: int = 0
    restored_from_version: int | None = None


def check_header(
    meta: PublishMeta,
    specs: Sequence[TensorSpec],
    *,
    latest_version: int,
    parent_specs: Sequence[TensorSpec] | None,
    max_bytes: int,
) -> None:
    """Raise InvalidPublishError / WrongParentError unless the header may follow the store's latest version.

    Rules: the first publish into an empty store has parent -1 (version 0, the initial weights, or a trainer's
    current version as a new base after its store was lost); every other one is parent + 1 with parent = the
    latest stored version, so versions have no gaps; restored_from_version R (a restarted trainer's rewind)
    supersedes R + 1 .. version - 1, so R < version - 1."""
    version, parent_version = meta.version, meta.parent_version
    if latest_version < 0:
        if parent_version != -1:
            raise WrongParentError(
                f"parent_version {parent_version} is not in the store: it is empty, so the first publish has "
                "parent_version -1",
                field="header.parent_version",
            )
        if version < 0:
            raise InvalidPublishError(f"version {version} must be >= 0", field="header.version")
        restored = meta.restored_from_version
        if restored is not None and not 0 <= restored < version - 1:
            raise InvalidPublishError(
                f"restored_from_version {restored} must be in [0, {version - 1}): it supersedes the versions after "
                f"it up to {version - 1}",
                field="header.restored_from_version",
            )
    else:
        _check_follows(meta, latest_version)
    if not specs:
        raise InvalidPublishError("a version needs at least one tensor", field="header.tensors")
    seen: set[str] = set()
    for index, spec in enumerate(specs):
        _check_spec(index, spec, seen)
    total = sum(spec.num_bytes for spec in specs)
    if total > max_bytes:
        raise InvalidPublishError(f"version is {total} bytes, more than max_publish_bytes {max_bytes}")
    if parent_specs is not None:
        _check_against_parent(specs, parent_specs)


def _check_follows(meta: PublishMeta, latest_version: int) -> None:
    version, parent_version = meta.version, meta.parent_version
    if version != parent_version + 1:
        raise InvalidPublishError(
            f"version {version} must be parent_version + 1 = {parent_version + 1}: versions have no gaps",
            field="header.version",
        )
    if parent_version != latest_version:
        gap = (
            f" (a gap: versions {latest_version + 1}..{parent_version} were never published here)"
            if parent_version > latest_version
            else ""
        )
        raise WrongParentError(
            f"parent_version {parent_version} is not the latest stored version {latest_version}{gap}",
            field="header.parent_version",
        )
    restored = meta.restored_from_version
    if restored is not None and not 0 <= restored < latest_version:
        raise InvalidPublishError(
            f"restored_from_version {restored} must be in [0, {latest_version}) (it supersedes the versions after "
            f"it up to the latest, {latest_version}; a trainer restored at the latest version republishes it)",
            field="header.restored_from_version",
        )


def _check_spec(index: int, spec: TensorSpec, seen: set[str]) -> None:
    field = f"header.tensors[{index}]"
    if not spec.name:
        raise InvalidPublishError("tensor name is empty", field=f"{field}.name")
    if spec.name in seen:
        raise InvalidPublishError(f"tensor {spec.name!r} appears twice", field=f"{field}.name")
    seen.add(spec.name)
    if spec.dtype not in DTYPE_ITEMSIZE:
        raise InvalidPublishError(
            f"dtype {spec.dtype!r} is not one of {sorted(DTYPE_ITEMSIZE)}", field=f"{field}.dtype"
        )
    if any(dim < 0 for dim in spec.shape):
        raise InvalidPublishError(f"shape {list(spec.shape)} has a negative dimension", field=f"{field}.shape")
    if not _SHA256_RE.match(spec.sha256):
        raise InvalidPublishError("sha256 must be 64 lower-case hex digits", field=f"{field}.sha256")


def _check_against_parent(specs: Sequence[TensorSpec], parent_specs: Sequence[TensorSpec]) -> None:
    previous = {spec.name: spec for spec in parent_specs}
    for index, spec in enumerate(specs):
        before = previous.get(spec.name)
        if before is None:
            raise InvalidPublishError(
                f"tensor {spec.name!r} is not in the parent version", field=f"header.tensors[{index}].name"
            )
        if before.dtype != spec.dtype:
            raise InvalidPublishError(
                f"tensor {spec.name!r} has dtype {spec.dtype}, the parent has {before.dtype}",
                field=f"header.tensors[{index}].dtype",
            )
        if before.shape != spec.shape:
            raise InvalidPublishError(
                f"tensor {spec.name!r} has shape {list(spec.shape)}, the parent has {list(before.shape)}",
                field=f"header.tensors[{index}].shape",
            )
    missing = previous.keys() - {spec.name for spec in specs}
    if missing:
        raise InvalidPublishError(f"tensor {sorted(missing)[0]!r} of the parent is missing", field="header.tensors")


class PublishAssembler:
    """Collects the chunks of one publish (each tensor's chunks in order, without gaps) and checks the commit.

    A tensor is hashed once complete: `add_chunk` returns True then, and an async caller may run
    `check_tensor(index)` in a thread meanwhile (hashlib releases the GIL); `commit` checks whatever is left.
    Tensors stay in the bytearrays they were assembled in (no second copy). The data channel fills a tensor
    without chunks: `receive_buffer` hands out its buffer for a socket's recv_into, `mark_received` says it is
    full (each from one thread per tensor; different tensors may fill from different threads at once).
    """

    def __init__(self, meta: PublishMeta, specs: Sequence[TensorSpec]) -> None:
        self.meta = meta
        self.specs = tuple(specs)
        self._buffers: list[bytearray | None] = [None] * len(self.specs)
        self._received = [0] * len(self.specs)
        self._checked = [False] * len(self.specs)

    @property
    def num_bytes_received(self) -> int:
        return sum(self._received)

    def add_chunk(self, tensor_index: int, offset: int, data: bytes | memoryview) -> bool:
        """Place a chunk; True when it completed its tensor."""
        if not 0 <= tensor_index < len(self.specs):
            raise InvalidPublishError(f"tensor_index {tensor_index} is out of range", field="chunk.tensor_index")
        spec = self.specs[tensor_index]
        if offset != self._received[tensor_index]:
            raise InvalidPublishError(
                f"chunk of {spec.name!r} at offset {offset}, expected {self._received[tensor_index]} (in order)",
                field="chunk.offset",
            )
        end = offset + len(data)
        if end > spec.num_bytes:
            raise InvalidPublishError(
                f"chunk runs past the {spec.num_bytes} bytes of {spec.name!r}", field="chunk.data"
            )
        buffer = self._buffers[tensor_index]
        if buffer is None:
            buffer = self._buffers[tensor_index] = bytearray(spec.num_bytes)
        buffer[offset:end] = data
        self._received[tensor_index] = end
        return end == spec.num_bytes and len(data) > 0

    def receive_buffer(self, index: int) -> memoryview:
        """Tensor `index`'s buffer, allocated now and writable, to be filled in place (once per tensor)."""
        spec = self.specs[index]
        if self._buffers[index] is not None or self._received[index]:
            raise InvalidPublishError(f"tensor {spec.name!r} is received twice", field=f"header.tensors[{index}]")
        buffer = self._buffers[index] = bytearray(spec.num_bytes)
        return memoryview(buffer)

    def mark_received(self, index: int) -> None:
        """Every byte of tensor `index` was written into the view `receive_buffer` returned."""
        self._received[index] = self.specs[index].num_bytes

    def check_tensor(self, index: int) -> None:
        """Raise InvalidPublishError unless tensor `index` is complete and matches its sha256."""
        spec = self.specs[index]
        if self._received[index] != spec.num_bytes:
            raise InvalidPublishError(
                f"tensor {spec.name!r} got {self._received[index]} of {spec.num_bytes} bytes (truncated)",
                field=f"header.tensors[{index}]",
            )
        buffer = self._buffers[index]
        if hashlib.sha256(buffer if buffer is not None else b"").hexdigest() != spec.sha256:
            raise InvalidPublishError(
                f"tensor {spec.name!r} does not match its sha256", field=f"header.tensors[{index}].sha256"
            )
        self._checked[index] = True

    def commit(self, manifest_sha256: str) -> PublishedVersion:
        """The checked version; raises InvalidPublishError on a truncated tensor or any checksum mismatch."""
        for index in range(len(self.specs)):
            if not self._checked[index]:
                self.check_tensor(index)
        if manifest_sha256 != manifest_digest([spec.sha256 for spec in self.specs]):
            raise InvalidPublishError(
                "manifest_sha256 does not match the tensors' checksums", field="commit.manifest_sha256"
            )
        data: dict[str, TensorBytes] = {}
        for index, spec in enumerate(self.specs):
            buffer = self._buffers[index]
            data[spec.name] = buffer if buffer is not None else b""
            self._buffers[index] = None
        meta = self.meta
        return PublishedVersion(
            meta.job_id,
            meta.version,
            meta.parent_version,
            self.specs,
            data,
            step_finished_unix_ms=meta.step_finished_unix_ms,
            restored_from_version=meta.restored_from_version,
        )
