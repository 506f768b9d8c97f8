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
class PublishedVersion:
    """A complete, checked version as the trainer sent it (raw bytes by name, specs in order)."""

    job_id: str
    version: int
    parent_version: int
    specs: tuple[TensorSpec, ...]
    data: dict[str, TensorBytes]


def check_header(
    *,
    version: int,
    parent_version: int,
    specs: Sequence[TensorSpec],
    latest_version: int,
    parent_specs: Sequence[TensorSpec] | None,
    max_bytes: int,
) -> None:
    """Raise InvalidPublishError / WrongParentError unless the header may follow the store's latest version."""
    if version < 0 or parent_version != version - 1:
        raise InvalidPublishError(
            f"version {version} must be parent_version + 1 (got parent_version {parent_version}); 0 at first",
            field="header.version",
        )
    if parent_version != latest_version:
        raise WrongParentError(
            f"parent_version {parent_version} is not the latest stored version {latest_version}",
            field="header.parent_version",
        )
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
    Tensors stay in the bytearrays they were assembled in (no second copy).
    """

    def __init__(self, job_id: str, version: int, parent_version: int, specs: Sequence[TensorSpec]) -> None:
        self.job_id = job_id
        self.version = version
        self.parent_version = parent_version
        self.specs = tuple(specs)
        self._buffers: list[bytearray | None] = [None] * len(self.specs)
        self._received = [0] * len(self.specs)
        self._checked = [False] * len(self.specs)
        self.num_bytes_received = 0

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
        self.num_bytes_received += len(data)
        return end == spec.num_bytes and len(data) > 0

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
        return PublishedVersion(self.job_id, self.version, self.parent_version, self.specs, data)
