"""The local backend's record of one job, kept in `<state_dir>/jobs/<job_id>/state.json`.

The file is the truth about which processes belong to the job (pids with their kernel start times, ports, restart
counts), so a restarted controller finds and adopts them. It is rewritten atomically (temp file, rename) after
every change. Logs, config files and pid files sit next to it.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from miles.controller.backends.local_processes import ProcessRecord

STATE_FILE = "state.json"


@dataclass
class LocalJob:
    """The per-job processes of one job and what the backend concluded about them."""

    job_id: str
    job_dir: Path
    processes: dict[str, ProcessRecord] = field(default_factory=dict)
    failed: bool = False
    error: str = ""
    """Why the job failed (a process out of restarts, an unsupported spec)."""
    notice: str = ""
    """The latest recoverable problem (a crashed process being restarted)."""
    was_running: bool = False
    """Every process was ready at least once (the job then reports `running` until it ends)."""
    stopped: bool = False
    succeeded: bool = False
    """The trainer reported its last step (kept after stop, so a repeated start/observe reports the end)."""
    last_step: int = 0
    """Trainer step last seen (reported while the trainer does not answer, e.g. after a controller restart)."""
    last_weight_version: int = 0
    record_routing: bool | None = None
    """The session server's resolved `record_routing` given at start (engines added by a resize need it too)."""
    shared_pool: str = ""
    """The shared engine pool the job's adapters are served by ("" = the job has engines of its own)."""

    def by_role(self, role: str) -> list[ProcessRecord]:
        records = [record for record in self.processes.values() if record.role == role]
        return sorted(records, key=lambda record: int(record.extra.get("index", 0)))

    def next_index(self, role: str) -> int:
        return max((int(record.extra.get("index", -1)) for record in self.by_role(role)), default=-1) + 1

    def save(self) -> None:
        data: dict[str, Any] = {
            "job_id": self.job_id,
            "failed": self.failed,
            "error": self.error,
            "notice": self.notice,
            "was_running": self.was_running,
            "stopped": self.stopped,
            "succeeded": self.succeeded,
            "last_step": self.last_step,
            "last_weight_version": self.last_weight_version,
            "record_routing": self.record_routing,
            "shared_pool": self.shared_pool,
            "processes": [record.to_json() for record in self.processes.values()],
        }
        self.job_dir.mkdir(parents=True, exist_ok=True)
        temp = self.job_dir / f".{STATE_FILE}.tmp"
        temp.touch(mode=0o600)  # the processes' environments hold the platform's tokens
        temp.chmod(0o600)
        temp.write_text(json.dumps(data, indent=1))
        os.replace(temp, self.job_dir / STATE_FILE)

    @classmethod
    def load(cls, job_id: str, job_dir: Path) -> LocalJob | None:
        """The saved job, or None when there is none (never started here, or its directory was removed)."""
        path = job_dir / STATE_FILE
        if not path.is_file():
            return None
        data = json.loads(path.read_text())
        records = [ProcessRecord.from_json(item) for item in data.get("processes", [])]
        return cls(
            job_id=job_id,
            job_dir=job_dir,
            processes={record.name: record for record in records},
            failed=bool(data.get("failed", False)),
            error=str(data.get("error", "")),
            notice=str(data.get("notice", "")),
            was_running=bool(data.get("was_running", False)),
            stopped=bool(data.get("stopped", False)),
            succeeded=bool(data.get("succeeded", False)),
            last_step=int(data.get("last_step", 0)),
            last_weight_version=int(data.get("last_weight_version", 0)),
            record_routing=data["record_routing"] if isinstance(data.get("record_routing"), bool) else None,
            shared_pool=str(data.get("shared_pool", "")),
        )
