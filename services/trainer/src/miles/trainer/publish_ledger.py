"""The trainer's record of every weight version it published: `<checkpoint_dir>/published_versions.jsonl`.

One JSON line per event, appended and fsynced:

- `{"event": "intent", "version", "parent_version", "step", "weights_digest", "restored_from_version", ...}`
  before a version leaves the process (the nccl and disk publishers push straight into engines, so a version can
  reach an engine before the trainer learns that it did);
- `{"event": "published", ...the same fields..., "num_bytes", "already_published"}` once it was accepted.

The ledger outlives checkpoints (a restarted trainer reads what its dead predecessor published), which is what
keeps version numbers honest after a crash: a trainer restored from the checkpoint of version R while versions
above R were published (or, for publishers without a store, possibly pushed) continues *after* the highest such
number, never reusing one (`supersede` below). It is also the trainer's testimony of which digest each version
had: every other party (the weight-sync store, each engine's `/weights_checker`) must report the same.

A torn last line (a crash mid-append) is ignored. Limits: a single writer (rank 0); the file grows by two short
lines per version.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

LEDGER_FILE = "published_versions.jsonl"


@dataclass(frozen=True)
class VersionRecord:
    """One published (or about to be published) version of the trainer's weights."""

    version: int
    parent_version: int
    step: int
    weights_digest: str
    restored_from_version: int | None = None
    """Set on a rewind: these are the restored weights of that version under a new number."""
    unix_ms: int = 0
    num_bytes: int = 0
    already_published: bool = False
    """The receiving side held this exact version already (a republish after a restart, a retry)."""


@dataclass(frozen=True)
class SupersededRange:
    """Versions first..last belong to a dead trainer's lineage; by_version re-published the restored weights."""

    first_version: int
    last_version: int
    by_version: int

    def __contains__(self, version: object) -> bool:
        return isinstance(version, int) and self.first_version <= version <= self.last_version


class PublishLedger:
    def __init__(self, checkpoint_dir: Path) -> None:
        self.path = checkpoint_dir / LEDGER_FILE
        checkpoint_dir.mkdir(parents=True, exist_ok=True)

    def _append(self, event: str, record: VersionRecord) -> None:
        line = json.dumps({"event": event, **asdict(record)})
        with self.path.open("a") as ledger:
            ledger.write(line + "\n")
            ledger.flush()
            os.fsync(ledger.fileno())

    def intent(self, record: VersionRecord) -> None:
        self._append("intent", record)

    def published(self, record: VersionRecord) -> None:
        self._append("published", record)

    def events(self) -> list[dict[str, Any]]:
        if not self.path.is_file():
            return []
        found = []
        for line in self.path.read_text().splitlines():
            try:
                found.append(json.loads(line))
            except json.JSONDecodeError:
                continue  # a torn line from a crash mid-append
        return found

    def records(self, event: str = "published") -> list[VersionRecord]:
        fields = VersionRecord.__dataclass_fields__
        return [
            VersionRecord(**{key: value for key, value in raw.items() if key in fields})
            for raw in self.events()
            if raw.get("event") == event
        ]

    def highest_version(self, *, include_intents: bool) -> int:
        """The highest version published (or, with include_intents, about to be); -1 when none."""
        versions = [r.version for r in self.records("published")]
        if include_intents:
            versions += [r.version for r in self.records("intent")]
        return max(versions, default=-1)

    def superseded(self) -> list[SupersededRange]:
        """Every range a rewind superseded, oldest first."""
        ranges = []
        for record in self.records("published"):
            restored = record.restored_from_version
            if restored is not None and record.version - 1 > restored:
                ranges.append(SupersededRange(restored + 1, record.version - 1, record.version))
        return list(dict.fromkeys(ranges))


def now_unix_ms() -> int:
    return int(time.time() * 1000)


def prune_version_dirs(root: Path, prefix: str, *, newest: int, keep_last: int) -> None:
    """Remove the `<prefix><version>` directories under `root` but the `keep_last` newest up to `newest` (the ones a
    publisher wrote for the engines to load; newer ones, from a run that resumed behind them, are left alone)."""
    versions = sorted(
        int(path.name.removeprefix(prefix))
        for path in root.glob(f"{prefix}*")
        if path.name.removeprefix(prefix).isdigit()
    )
    for version in [v for v in versions if v <= newest][:-keep_last]:
        shutil.rmtree(root / f"{prefix}{version:06d}", ignore_errors=True)
