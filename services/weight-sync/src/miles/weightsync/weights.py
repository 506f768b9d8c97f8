"""Full weights of one version in memory (`WeightSet`), and moving between a store's representation and them.

- `encode_version` turns a published version into stored tensors (a snapshot, or deltas against the parent);
- `materialize` rebuilds any stored version from the snapshot its chain starts at;
- `advance` moves a WeightSet forward through stored deltas (what the delta transport does next to an engine).

Every tensor that is decoded is checked against its manifest sha256 before it is returned, so a WeightSet
built here is exactly what the trainer published; any mismatch raises DeltaVerificationError (the delta or the
local copy it was applied to is wrong) and nothing is returned. Unchanged tensors share one bytes object between
versions, so consecutive versions cost only what changed.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass

from miles.weightsync.delta import DELTA_ENCODINGS, decode, encode_delta, encode_full
from miles.weightsync.errors import DeltaVerificationError, StoreCorruptError
from miles.weightsync.manifest import Manifest, StoredTensor, TensorBytes, TensorSpec, manifest_digest
from miles.weightsync.store import VersionStore


@dataclass(frozen=True)
class WeightSet:
    """Every tensor of `version`: specs in publish order and raw bytes by name (len == spec.num_bytes)."""

    version: int
    specs: tuple[TensorSpec, ...]
    data: Mapping[str, TensorBytes]

    @property
    def manifest_sha256(self) -> str:
        return manifest_digest([spec.sha256 for spec in self.specs])

    @property
    def full_bytes(self) -> int:
        return sum(spec.num_bytes for spec in self.specs)

    def changed_since(self, other: WeightSet | None) -> list[TensorSpec]:
        """Specs whose bytes differ from `other`'s (all of them when other is None or has another layout)."""
        if other is None:
            return list(self.specs)
        previous = {spec.name: spec for spec in other.specs}
        return [s for s in self.specs if s.name not in previous or previous[s.name] != s]


def sha256_hex(data: TensorBytes | memoryview) -> str:
    return hashlib.sha256(data).hexdigest()


def _verified(spec: TensorSpec, data: bytes, version: int) -> bytes:
    if len(data) != spec.num_bytes or sha256_hex(data) != spec.sha256:
        raise DeltaVerificationError(
            f"tensor {spec.name!r} of version {version} does not match its checksum after decoding",
            field=spec.name,
        )
    return data


def encode_version(
    specs: tuple[TensorSpec, ...],
    data: Mapping[str, TensorBytes],
    parent: WeightSet | None,
    *,
    snapshot: bool,
    level: int,
) -> tuple[list[StoredTensor], dict[str, bytes]]:
    """Stored tensors (in spec order) and the blobs to write (by sha256) for a new version."""
    stored: list[StoredTensor] = []
    blobs: dict[str, bytes] = {}
    for spec in specs:
        raw = data[spec.name]
        if snapshot or parent is None:
            encoded = encode_full(raw, level=level)
            num_changed = spec.num_elements
        else:
            encoded = encode_delta(parent.data[spec.name], raw, spec.itemsize, level=level)
            num_changed = encoded.num_changed
        blob_sha256 = sha256_hex(encoded.blob)
        blobs[blob_sha256] = encoded.blob
        stored.append(StoredTensor(spec, encoded.encoding, blob_sha256, len(encoded.blob), num_changed))
    return stored, blobs


def apply_manifest(store: VersionStore, manifest: Manifest, parent: WeightSet | None) -> WeightSet:
    """The WeightSet of `manifest` given its parent's (None only for a snapshot); every decoded tensor verified."""
    if parent is not None and parent.version != manifest.parent_version:
        raise StoreCorruptError(f"version {manifest.version} follows {manifest.parent_version}, not {parent.version}")
    previous = {spec.name: spec for spec in parent.specs} if parent is not None else {}
    data: dict[str, TensorBytes] = {}
    for tensor in manifest.tensors:
        spec = tensor.spec
        is_delta = tensor.encoding in DELTA_ENCODINGS
        if is_delta and (parent is None or spec.name not in previous or not previous[spec.name].same_layout(spec)):
            raise StoreCorruptError(f"delta of tensor {spec.name!r} has no matching parent tensor", field=spec.name)
        if is_delta and tensor.num_changed == 0 and parent is not None:
            if previous[spec.name].sha256 != spec.sha256:
                raise DeltaVerificationError(f"tensor {spec.name!r} is marked unchanged but its checksum differs")
            data[spec.name] = parent.data[spec.name]
            continue
        base = parent.data[spec.name] if is_delta and parent is not None else None
        raw = decode(
            tensor.encoding,
            store.get_blob(tensor.blob_sha256),
            num_bytes=spec.num_bytes,
            itemsize=spec.itemsize,
            base=base,
        )
        data[spec.name] = _verified(spec, raw, manifest.version)
    return WeightSet(manifest.version, manifest.specs, data)


def advance(store: VersionStore, weights: WeightSet, target_version: int) -> WeightSet:
    """`weights` moved forward to `target_version` through the stored versions in between."""
    if target_version < weights.version:
        raise StoreCorruptError(f"cannot move weights back from version {weights.version} to {target_version}")
    current = weights
    for version in range(weights.version + 1, target_version + 1):
        current = apply_manifest(store, store.get_manifest(version), current)
    return current


def materialize(store: VersionStore, version: int) -> WeightSet:
    """Rebuild `version` from the snapshot its delta chain starts at."""
    manifest = store.get_manifest(version)
    start = store.get_manifest(manifest.snapshot_version) if manifest.snapshot_version != version else manifest
    weights = apply_manifest(store, start, None)
    return advance(store, weights, version)
