"""The version store of one job: immutable, content-addressed blobs plus one manifest per version, on any
fsspec filesystem (a local or PVC directory, s3://, gs://, memory:// in tests).

Layout under `<store root>/<job_id>/`:

    objects/<sha256[:2]>/<sha256>     a tensor's stored form (delta.py), named by the sha256 of its bytes
    versions/<version:012d>.json      the version's manifest (manifest.py), written last: the commit point
    superseded.json                   ranges of versions a restarted trainer superseded (written before the
                                      manifest of the version that supersedes them; kept through retention)

Blobs are written once (identical content has the same name, so rewriting is a no-op) and checked against their
name on every read. A manifest is never replaced by a different one. A version exists once its manifest does; a
crash between blobs and manifest leaves only unreferenced blobs, which the next retention pass deletes.
Local filesystems get temp-file + rename writes; object stores' single PUTs are atomic already.

Retention keeps the newest `retain_versions` versions and everything their delta chains need (back to the
snapshot each one starts from), then deletes blobs no kept manifest references. Only the daemon that writes a
store (the origin, or a daemon replicating into its own store) runs it, under its write lock.

All methods are synchronous (fsspec); async callers run them in a thread.
"""

from __future__ import annotations

import hashlib
import json
import uuid
from dataclasses import dataclass

import fsspec  # type: ignore[import-untyped]
from fsspec.implementations.local import LocalFileSystem  # type: ignore[import-untyped]

from miles.weightsync.errors import StoreCorruptError, VersionNotFoundError, WrongParentError
from miles.weightsync.manifest import Manifest

_VERSION_DIGITS = 12


@dataclass(frozen=True)
class SupersededRange:
    """Versions first_version..last_version (a dead trainer's) were superseded by by_version (its successor's
    restored checkpoint, published under a new number)."""

    first_version: int
    last_version: int
    by_version: int


@dataclass(frozen=True)
class RetentionResult:
    deleted_versions: tuple[int, ...]
    deleted_blobs: int


class VersionStore:
    """Blobs and manifests of one job under `url` (an fsspec URL or a local path)."""

    def __init__(self, url: str, job_id: str) -> None:
        fs, root = fsspec.core.url_to_fs(url)
        self.fs: fsspec.AbstractFileSystem = fs
        self.url = url
        self.job_id = job_id
        self.root = f"{root.rstrip('/')}/{job_id}"
        self._atomic_rename = isinstance(fs, LocalFileSystem)

    # --- paths -------------------------------------------------------------------------------------------------
    def blob_path(self, sha256: str) -> str:
        return f"{self.root}/objects/{sha256[:2]}/{sha256}"

    def manifest_path(self, version: int) -> str:
        return f"{self.root}/versions/{version:0{_VERSION_DIGITS}d}.json"

    # --- blobs -------------------------------------------------------------------------------------------------
    def has_blob(self, sha256: str) -> bool:
        return bool(self.fs.exists(self.blob_path(sha256)))

    def put_blob(self, data: bytes) -> str:
        """Store `data` under its sha256 (no-op when present); returns the sha256."""
        sha256 = hashlib.sha256(data).hexdigest()
        path = self.blob_path(sha256)
        if not self.fs.exists(path):
            self._write(path, data)
        return sha256

    def get_blob(self, sha256: str) -> bytes:
        """The blob's bytes; raises StoreCorruptError when missing or not matching its name."""
        path = self.blob_path(sha256)
        try:
            data = bytes(self.fs.cat_file(path))
        except FileNotFoundError:
            raise StoreCorruptError(f"blob {sha256} is missing from the store", field="blob_sha256") from None
        if hashlib.sha256(data).hexdigest() != sha256:
            raise StoreCorruptError(f"blob {sha256} does not match its content address", field="blob_sha256")
        return data

    # --- manifests ---------------------------------------------------------------------------------------------
    def put_manifest(self, manifest: Manifest) -> None:
        """Commit a version: write its manifest once. An identical manifest already present is fine (replicas);
        a different one raises WrongParentError (versions are immutable)."""
        path = self.manifest_path(manifest.version)
        text = manifest.to_json()
        if self.fs.exists(path):
            if Manifest.from_json(self.fs.cat_file(path).decode()).manifest_sha256 != manifest.manifest_sha256:
                raise WrongParentError(f"version {manifest.version} is already stored with other weights")
            return
        self._write(path, text.encode())

    def has_version(self, version: int) -> bool:
        return bool(self.fs.exists(self.manifest_path(version)))

    def get_manifest(self, version: int) -> Manifest:
        try:
            text = self.fs.cat_file(self.manifest_path(version)).decode()
        except FileNotFoundError:
            raise VersionNotFoundError(f"version {version} is not in the store", field="version") from None
        try:
            return Manifest.from_json(text)
        except (ValueError, KeyError, TypeError) as exc:
            raise StoreCorruptError(f"manifest of version {version} is unreadable: {exc}") from exc

    def list_versions(self) -> list[int]:
        directory = f"{self.root}/versions"
        if not self.fs.exists(directory):
            return []
        versions = []
        for path in self.fs.ls(directory, detail=False):
            name = str(path).rsplit("/", 1)[-1]
            if name.endswith(".json") and name[:-5].isdigit():
                versions.append(int(name[:-5]))
        return sorted(versions)

    def latest_version(self) -> int:
        versions = self.list_versions()
        return versions[-1] if versions else -1

    # --- supersession -------------------------------------------------------------------------------------------
    def superseded(self) -> list[SupersededRange]:
        """Every superseded range recorded, oldest first."""
        path = f"{self.root}/superseded.json"
        try:
            raw = json.loads(self.fs.cat_file(path).decode())
        except FileNotFoundError:
            return []
        except (ValueError, UnicodeDecodeError) as exc:
            raise StoreCorruptError(f"superseded.json is unreadable: {exc}") from exc
        return [SupersededRange(int(r["first_version"]), int(r["last_version"]), int(r["by_version"])) for r in raw]

    def add_superseded(self, entry: SupersededRange) -> None:
        """Record a range (a no-op when it is recorded already: a retried publish writes it again)."""
        entries = self.superseded()
        if entry in entries:
            return
        entries.append(entry)
        body = [
            {"first_version": e.first_version, "last_version": e.last_version, "by_version": e.by_version}
            for e in entries
        ]
        self._write(f"{self.root}/superseded.json", json.dumps(body).encode())

    # --- retention ---------------------------------------------------------------------------------------------
    def apply_retention(self, retain_versions: int) -> RetentionResult:
        """Delete versions older than every kept chain needs, then blobs no kept manifest references."""
        versions = self.list_versions()
        kept = versions[-retain_versions:]
        if not kept:
            return RetentionResult((), 0)
        keep_from = min(self.get_manifest(v).snapshot_version for v in kept)
        doomed = [v for v in versions if v < keep_from]
        for version in doomed:
            self.fs.rm_file(self.manifest_path(version))
        referenced: set[str] = set()
        for version in versions:
            if version >= keep_from:
                referenced.update(self.get_manifest(version).blob_sha256s())
        num_deleted = 0
        for path in self._blob_paths():
            if path.rsplit("/", 1)[-1] not in referenced:
                self.fs.rm_file(path)
                num_deleted += 1
        return RetentionResult(tuple(doomed), num_deleted)

    def _blob_paths(self) -> list[str]:
        directory = f"{self.root}/objects"
        if not self.fs.exists(directory):
            return []
        return [str(p) for p in self.fs.find(directory) if ".tmp-" not in str(p)]

    def _write(self, path: str, data: bytes) -> None:
        """Write (or replace) a file whole: temp file + rename locally, one PUT on object stores."""
        parent = path.rsplit("/", 1)[0]
        self.fs.makedirs(parent, exist_ok=True)
        if not self._atomic_rename:
            self.fs.pipe_file(path, data)
            return
        temp = f"{path}.tmp-{uuid.uuid4().hex}"
        self.fs.pipe_file(temp, data)
        self.fs.mv(temp, path)
