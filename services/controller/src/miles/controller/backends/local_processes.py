"""Processes of the local backend: spawn one detached from the controller, recognise it again, stop it.

A process record (`ProcessRecord`) is everything needed to start a per-job process again and to find it after a
controller restart: argv, the environment it adds, its log file, its pid and the kernel's start time of that pid.
The start time (field 22 of `/proc/<pid>/stat`, clock ticks since boot) is what tells *our* process from another
one that reused the pid, so a controller restart never adopts (or kills) a stranger.

Processes are started by miles.common.spawn in their own session with no parent-death signal, so they outlive
the controller; stopping signals the whole process group. Linux only (`/proc`).

Limits: a process that the controller did not start itself (adopted) leaves no exit code to read (its parent is
now init), so its exit is reported as -1.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from miles.common.spawn import ProcessSpec, signal_process, spawn

PROCESS_ROLES = ("engine", "weightsync", "worker", "trainer")
"""Kinds of per-job process, in start order."""


def proc_start_time(pid: int) -> int | None:
    """Kernel start time of `pid` (clock ticks since boot), or None when no such live (non-zombie) process."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    # The command name (field 2) may contain spaces and parentheses: parse after its last ')'.
    fields = stat[stat.rindex(")") + 2 :].split()
    if fields[0] in ("Z", "X"):
        return None
    return int(fields[19])


@dataclass
class ProcessRecord:
    """One per-job process: how to start it and, once started, which kernel process it is."""

    name: str
    """Unique within the job: `engine-0`, `weightsync`, `worker-1`, `trainer`."""
    role: str
    """One of PROCESS_ROLES."""
    argv: list[str]
    env: dict[str, str]
    """Variables added to the controller's environment."""
    log_path: str
    ready_url: str = ""
    """HTTP URL answering 200 once the process serves ("" = ready as soon as it runs)."""
    url: str = ""
    """What the rest of the job knows the process by (an engine's base URL, a gRPC address)."""
    pid: int = 0
    start_time: int = 0
    started_at_s: float = 0.0
    """Wall-clock time of the last start."""
    restarts: int = 0
    """Restarts in a row without a stable run (reset after `restart_reset_s` of uptime)."""
    total_restarts: int = 0
    next_start_at_s: float = 0.0
    """When a crashed process may be started again (exponential backoff); 0 = not waiting."""
    last_exit_code: int | None = None
    ready: bool = False
    registered: bool = False
    """Engines: registered with the router's pool of the job."""
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ProcessRecord:
        return cls(**data)


class ProcessTable:
    """Starts, recognises and stops the processes of the local backend.

    Keeps the `Popen` of each process this controller started, so exit codes are read and zombies reaped.
    """

    def __init__(self, cwd: Path) -> None:
        self.cwd = cwd
        self._children: dict[int, subprocess.Popen[bytes]] = {}

    def spawn(self, record: ProcessRecord, pid_dir: Path) -> None:
        """Start `record`'s process now (log appended), and fill in its pid and start time."""
        spec = ProcessSpec(tuple(record.argv), Path(record.log_path), record.env, cwd=self.cwd, log_banner=True)
        child = spawn(spec)
        self._children[child.pid] = child
        record.pid = child.pid
        record.start_time = proc_start_time(child.pid) or 0
        record.started_at_s = time.time()
        record.ready = False
        record.registered = False
        record.next_start_at_s = 0.0
        (pid_dir / f"{record.name}.pid").write_text(f"{record.pid} {record.start_time}\n")

    def exit_code(self, record: ProcessRecord) -> int | None:
        """None while `record`'s process runs; its exit code (-1 when unknown) once it is gone."""
        if record.pid <= 0:
            return -1
        child = self._children.get(record.pid)
        if child is not None:
            code = child.poll()
            if code is not None:
                self._children.pop(record.pid, None)
            return code
        current = proc_start_time(record.pid)
        if current is None or current != record.start_time:
            return -1
        return None

    def is_running(self, record: ProcessRecord) -> bool:
        return self.exit_code(record) is None

    def signal(self, record: ProcessRecord, signum: int) -> None:
        """Send `signum` to the process's group (its own session), else to the process; nothing if it is gone."""
        if self.is_running(record):
            signal_process(record.pid, signum)

    def stop_all(self, records: list[ProcessRecord], grace_s: float) -> None:
        """SIGTERM every process, wait up to `grace_s` for all, then SIGKILL those left (blocking)."""
        for record in records:
            self.signal(record, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and any(self.is_running(record) for record in records):
            time.sleep(0.05)
        for record in records:
            if self.is_running(record):
                self.signal(record, signal.SIGKILL)
        deadline = time.monotonic() + 5.0
        while time.monotonic() < deadline and any(self.is_running(record) for record in records):
            time.sleep(0.05)


def log_tail(path: str | Path, num_chars: int = 2000) -> str:
    """The end of a log file ("" when it does not exist)."""
    try:
        with Path(path).open("rb") as log_file:
            log_file.seek(0, os.SEEK_END)
            size = log_file.tell()
            log_file.seek(max(0, size - num_chars))
            return log_file.read().decode(errors="replace")
    except FileNotFoundError:
        return ""
