"""Sandbox uids (setuid mode): one uid per live sandbox, so that files, signals, ptrace and RLIMIT_NPROC
separate sandboxes from each other as well as from the host. A uid is reused only after no process runs
under it any more (kill_uid_processes), and least recently released first.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections import deque

from miles.sandbox.errors import SandboxStartFailedError


class UidPool:
    def __init__(self, start: int, size: int) -> None:
        self._free: deque[int] = deque(range(start, start + size))

    def take(self) -> int:
        if not self._free:
            message = "no free sandbox uid (uid_range_size local sandboxes are live)"
            raise SandboxStartFailedError(message, retry_after_s=1.0)
        return self._free.popleft()

    def release(self, uid: int) -> None:
        self._free.append(uid)


def processes_of_uid(uid: int, proc_root: str = "/proc") -> list[int]:
    """Live (non-zombie) processes whose real, effective or saved uid is `uid`."""
    found: list[int] = []
    for entry in os.scandir(proc_root):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"{proc_root}/{entry.name}/status", encoding="ascii", errors="replace") as status_file:
                status = status_file.read()
        except OSError:
            continue
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        uids = fields.get("Uid", "").split()[:3]
        if str(uid) in uids and not fields.get("State", "").strip().startswith("Z"):
            found.append(int(entry.name))
    return found


def kill_uid_processes(uid: int, attempts: int = 50) -> bool:
    """SIGKILL every process running under `uid` until none is left; False if some survive every attempt."""
    for _ in range(attempts):
        pids = processes_of_uid(uid)
        if not pids:
            return True
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.01)
    return not processes_of_uid(uid)
