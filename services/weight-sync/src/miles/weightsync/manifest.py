"""What a stored version is: tensor specs, how each tensor is stored, and the version's manifest.

A manifest is immutable once written. Its content address (`manifest_sha256`) is the sha256 over the
concatenated hex sha256 strings of its tensors' raw bytes, in order — the same value the trainer sends in
PublishCommit — so two versions with identical weights have the same address. Each tensor's stored form is a
blob named by the sha256 of its bytes (see store.py), encoded per delta.py: a full copy or a lossless delta
against the same tensor of the parent version.

Dtypes are torch's names without the "torch." prefix; only their element size matters here (bit patterns are
compared and XORed, never interpreted as numbers), so no torch import is needed.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from miles.common.weights import weights_digest

DTYPE_ITEMSIZE: dict[str, int] = {
    "bfloat16": 2,
    "float16": 2,
    "float32": 4,
    "float64": 8,
    "uint8": 1,
    "int8": 1,
    "int16": 2,
    "int32": 4,
    "int64": 8,
    "bool": 1,
}
SAFETENSORS_DTYPE: dict[str, str] = {
    "bfloat16": "BF16",
    "float16": "F16",
    "float32": "F32",
    "float64": "F64",
    "uint8": "U8",
    "int8": "I8",
    "int16": "I16",
    "int32": "I32",
    "int64": "I64",
    "bool": "BOOL",
}
MANIFEST_FORMAT = 1
TensorBytes = bytes | bytearray
"""A tensor's raw little-endian bytes (received tensors stay in the bytearray they were assembled in)."""


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of a version: HF name, dtype, shape and the sha256 of its raw little-endian bytes."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    sha256: str

    @property
    def itemsize(self) -> int:
        return DTYPE_ITEMSIZE[self.dtype]

    @property
    def num_elements(self) -> int:
        return math.prod(self.shape)

    @property
    def num_bytes(self) -> int:
        return self.num_elements * self.itemsize

    def same_layout(self, other: TensorSpec) -> bool:
        return (self.name, self.dtype, self.shape) == (other.name, other.dtype, other.shape)


@dataclass(frozen=True)
class StoredTensor:
    """How one tensor of a version is stored: `encoding` (delta.py) of blob `blob_sha256` (`stored_bytes` long).

    `num_changed` counts elements whose bit pattern differs from the parent's (all of them for a full copy
    without parent). Delta encodings need the same tensor of the parent version to decode.
    """

    spec: TensorSpec
    encoding: str
    blob_sha256: str
    stored_bytes: int
    num_changed: int


def manifest_digest(sha256s: Sequence[str]) -> str:
    """The content address of a version: sha256 over the tensors' hex sha256 strings (ASCII), in order."""
    digest = hashlib.sha256()
    for value in sha256s:
        digest.update(value.encode("ascii"))
    return digest.hexdigest()


@dataclass(frozen=True)
class Manifest:
    """An immutable stored version. `snapshot_version` is the newest full snapshot its delta chain starts from
    (itself for a snapshot)."""

    job_id: str
    version: int
    parent_version: int
    created_at_unix_ms: int
    is_snapshot: bool
    snapshot_version: int
    tensors: tuple[StoredTensor, ...]
    step_finished_unix_ms: int = 0
    """When the trainer's optimizer step that produced this version finished (0: unknown)."""
    restored_from_version: int | None = None
    """Set when a restarted trainer published the weights of its checkpoint of this version under this number
    (the versions in between are superseded)."""

    @property
    def manifest_sha256(self) -> str:
        return manifest_digest([t.spec.sha256 for t in self.tensors])

    @property
    def weights_digest(self) -> str:
        """The order-independent digest engines and trainers report (miles.common.weights)."""
        return weights_digest({t.spec.name: t.spec.sha256 for t in self.tensors})

    @property
    def specs(self) -> tuple[TensorSpec, ...]:
        return tuple(t.spec for t in self.tensors)

    @property
    def full_bytes(self) -> int:
        return sum(t.spec.num_bytes for t in self.tensors)

    @property
    def stored_bytes(self) -> int:
        return sum(t.stored_bytes for t in self.tensors)

    @property
    def num_elements(self) -> int:
        return sum(t.spec.num_elements for t in self.tensors)

    @property
    def num_changed(self) -> int:
        return sum(t.num_changed for t in self.tensors)

    def blob_sha256s(self) -> list[str]:
        return sorted({t.blob_sha256 for t in self.tensors})

    def to_json(self) -> str:
        body: dict[str, Any] = {
            "format": MANIFEST_FORMAT,
            "job_id": self.job_id,
            "version": self.version,
            "parent_version": self.parent_version,
            "created_at_unix_ms": self.created_at_unix_ms,
            "is_snapshot": self.is_snapshot,
            "snapshot_version": self.snapshot_version,
            "manifest_sha256": self.manifest_sha256,
            "step_finished_unix_ms": self.step_finished_unix_ms,
            "restored_from_version": self.restored_from_version,
            "tensors": [
                {
                    "name": t.spec.name,
                    "dtype": t.spec.dtype,
                    "shape": list(t.spec.shape),
                    "sha256": t.spec.sha256,
                    "encoding": t.encoding,
                    "blob_sha256": t.blob_sha256,
                    "stored_bytes": t.stored_bytes,
                    "num_changed": t.num_changed,
                }
                for t in self.tensors
            ],
        }
        return json.dumps(body, indent=1)

    @classmethod
    def from_json(cls, text: str) -> Manifest:
        """Parse a stored manifest; raises ValueError when it is malformed or its content address is wrong."""
        raw = json.loads(text)
        if raw.get("format") != MANIFEST_FORMAT:
            raise ValueError(f"unknown manifest format {raw.get('format')!r}")
        tensors = tuple(
            StoredTensor(
                spec=TensorSpec(t["name"], t["dtype"], tuple(int(d) for d in t["shape"]), t["sha256"]),
                encoding=t["encoding"],
                blob_sha256=t["blob_sha256"],
                stored_bytes=int(t["stored_bytes"]),
                num_changed=int(t["num_changed"]),
            )
            for t in raw["tensors"]
        )
        manifest = cls(
            job_id=raw["job_id"],
            version=int(raw["version"]),
            parent_version=int(raw["parent_version"]),
            created_at_unix_ms=int(raw["created_at_unix_ms"]),
            is_snapshot=bool(raw["is_snapshot"]),
            snapshot_version=int(raw["snapshot_version"]),
            tensors=tensors,
            step_finished_unix_ms=int(raw.get("step_finished_unix_ms", 0)),
            restored_from_version=_optional_int(raw.get("restored_from_version")),
        )
        if manifest.manifest_sha256 != raw.get("manifest_sha256"):
            raise ValueError(f"manifest of version {manifest.version} does not match its content address")
        return manifest


def _optional_int(value: Any) -> int | None:
    return None if value is None else int(value)
