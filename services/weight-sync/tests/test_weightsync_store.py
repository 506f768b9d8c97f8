"""The version store through the daemon's core, on a local directory and on fsspec's memory:// filesystem:
snapshots every snapshot_interval versions and deltas between, bit-exact reconstruction, content addressing,
immutability, retention, and corruption detection."""

from __future__ import annotations

import hashlib
import uuid
from pathlib import Path

import numpy as np
import pytest

from miles.common.settings import load_settings
from miles.common.telemetry import Metrics
from miles.weightsync.core import WeightSyncCore
from miles.weightsync.errors import DeltaVerificationError, StoreCorruptError, WrongParentError
from miles.weightsync.manifest import TensorSpec
from miles.weightsync.publish import PublishAssembler, PublishMeta
from miles.weightsync.settings import WeightsyncSettings
from miles.weightsync.weights import WeightSet, advance, materialize

SHAPES = {"embed": (512, 64), "layer.0.w": (64, 64), "norm": (64,)}


@pytest.fixture(params=["local", "memory"])
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    return str(tmp_path / "store") if request.param == "local" else f"memory://ws-test-{uuid.uuid4().hex}"


def make_core(store_url: str, **overrides: object) -> WeightSyncCore:
    fields: dict[str, object] = {
        "job_id": "job-s",
        "store_url": store_url,
        "snapshot_interval": 3,
        "retain_versions": 2,
        "auto_update": False,
        "pause_mode": "abort",
    }
    settings = load_settings(WeightsyncSettings, **{**fields, **overrides})
    return WeightSyncCore(settings, Metrics("weightsync"))


def weights_sequence(num_versions: int, seed: int = 0) -> list[dict[str, bytes]]:
    """bf16-like bit patterns; each version flips low bits of ~1% of the words of the previous one."""
    rng = np.random.default_rng(seed)
    current = {name: rng.integers(0, 2**16, shape, dtype=np.uint16) for name, shape in SHAPES.items()}
    versions = []
    for _ in range(num_versions):
        versions.append({name: words.tobytes() for name, words in current.items()})
        for words in current.values():
            flat = words.reshape(-1)
            flat[rng.choice(flat.size, max(1, flat.size // 100), replace=False)] ^= 1
    return versions


def specs_of(data: dict[str, bytes]) -> list[TensorSpec]:
    return [TensorSpec(name, "bfloat16", SHAPES[name], hashlib.sha256(data[name]).hexdigest()) for name in SHAPES]


async def publish(core: WeightSyncCore, version: int, data: dict[str, bytes]) -> None:
    specs = specs_of(data)
    begun = await core.intake.begin_publish(PublishMeta("job-s", version, version - 1), specs)
    assert isinstance(begun, PublishAssembler)
    assembler = begun
    for index, spec in enumerate(specs):
        assembler.add_chunk(index, 0, data[spec.name][:100])
        assembler.add_chunk(index, 100, data[spec.name][100:])
    published = assembler.commit(WeightSet(version, tuple(specs), data).manifest_sha256)
    await core.intake.store_published(published)


async def test_versions_rebuild_bit_exact_from_snapshots_and_deltas(store_url: str) -> None:
    core = make_core(store_url, retain_versions=50)
    versions = weights_sequence(8)
    for version, data in enumerate(versions):
        await publish(core, version, data)
    store = core.store
    assert store.list_versions() == list(range(8))
    for version, data in enumerate(versions):
        manifest = store.get_manifest(version)
        assert manifest.is_snapshot == (version % 3 == 0)
        assert manifest.snapshot_version == version - version % 3
        if not manifest.is_snapshot:
            assert manifest.stored_bytes < 0.1 * manifest.full_bytes
            assert 0 < manifest.num_changed < manifest.num_elements
        rebuilt = materialize(store, version)
        assert {name: bytes(raw) for name, raw in rebuilt.data.items()} == data
    await core.close()


async def test_blobs_are_content_addressed_and_versions_immutable(store_url: str) -> None:
    core = make_core(store_url)
    versions = weights_sequence(2)
    await publish(core, 0, versions[0])
    await publish(core, 1, versions[1])
    store = core.store
    for sha256 in store.get_manifest(1).blob_sha256s():
        assert hashlib.sha256(store.get_blob(sha256)).hexdigest() == sha256
    assert store.put_blob(store.get_blob(sha256)) == sha256  # rewriting identical content is a no-op
    other = store.get_manifest(0)
    with pytest.raises(WrongParentError, match="already stored"):
        store.put_manifest(type(other)(**{**other.__dict__, "version": 1}))
    store.put_manifest(store.get_manifest(1))  # an identical manifest (a replica) is fine
    await core.close()


async def test_retention_keeps_every_chain_and_drops_unreferenced_blobs(store_url: str) -> None:
    core = make_core(store_url)
    versions = weights_sequence(8)
    for version, data in enumerate(versions[:6]):
        await publish(core, version, data)
    store = core.store
    assert store.list_versions() == [3, 4, 5]  # keep 4 and 5, and snapshot 3 their deltas start from
    await publish(core, 6, versions[6])
    await publish(core, 7, versions[7])
    assert store.list_versions() == [6, 7]
    referenced = set(store.get_manifest(6).blob_sha256s()) | set(store.get_manifest(7).blob_sha256s())
    stored = {path.rsplit("/", 1)[-1] for path in store.fs.find(f"{store.root}/objects")}
    assert stored == referenced
    assert {n: bytes(r) for n, r in materialize(store, 7).data.items()} == versions[7]
    await core.close()


async def test_corrupt_blob_and_wrong_base_are_detected(store_url: str) -> None:
    core = make_core(store_url, retain_versions=50)
    versions = weights_sequence(3)
    for version, data in enumerate(versions):
        await publish(core, version, data)
    store = core.store
    v1 = materialize(store, 1)
    tampered = WeightSet(1, v1.specs, {**v1.data, "embed": bytes(len(v1.data["embed"]))})
    with pytest.raises(DeltaVerificationError):
        advance(store, tampered, 2)  # a delta applied to the wrong local copy
    blob = next(t.blob_sha256 for t in store.get_manifest(2).tensors if t.spec.name == "embed")
    path = store.blob_path(blob)
    data = bytearray(store.fs.cat_file(path))
    data[len(data) // 2] ^= 0xFF
    store.fs.pipe_file(path, bytes(data))
    with pytest.raises(StoreCorruptError):
        advance(store, v1, 2)
    await core.close()
