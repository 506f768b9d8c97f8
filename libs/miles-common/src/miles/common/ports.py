"""Free TCP ports for processes started on this machine (`miles up`, the local backend, tests).

A port is picked at random below the kernel's ephemeral range (`net.ipv4.ip_local_port_range`), not by binding
port 0: the kernel hands ports of the ephemeral range to every outgoing connection and every `bind(0)` (gloo's
and NCCL's rendezvous sockets, HTTP clients), so a port it picked for us a moment ago is exactly the kind it may
give to someone else before our child process binds it. Below the range, only another `free_port` caller can
take it: each process remembers what it handed out, and every process of this user on the machine records each
port it hands out (a marker file under the temp directory) and skips ports another one handed out within
RESERVATION_S. Without that record, a test worker's port could go to another worker while the first one's child
was still importing torch (seconds under load); the other's server then answered the first's readiness probe.
"""

from __future__ import annotations

import fcntl
import os
import random
import socket
import tempfile
import time
from collections import deque
from pathlib import Path

EPHEMERAL_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
LOWEST_PORT = 10000
"""Never below this: well-known and commonly configured service ports live lower."""
MIN_RANGE_SIZE = 1000
"""Fewer ports than this below the ephemeral range: let the OS pick instead."""
MAX_ATTEMPTS = 64
RESERVATION_S = 300.0
"""A port handed out by any process of this user is not handed out again for this long: the time its process has
to bind it."""
_RANDOM = random.SystemRandom()  # immune to tests seeding the global `random`: workers must not pick alike
_handed_out: deque[int] = deque(maxlen=4096)


def ephemeral_range_start(path: Path = EPHEMERAL_RANGE_FILE) -> int | None:
    """The first port of the kernel's ephemeral range, None where it cannot be read (not Linux)."""
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on `host` that was free a moment ago and that the kernel does not give out on its own.

    Limit: the port is released before the caller's process binds it, so another `free_port` caller (another
    process) may pick it in between; rare (random picks among thousands), and the caller sees a failed start-up."""
    start = ephemeral_range_start()
    if start is not None and start - LOWEST_PORT >= MIN_RANGE_SIZE:
        for _ in range(MAX_ATTEMPTS):
            port = _RANDOM.randrange(LOWEST_PORT, start)
            if port not in _handed_out and _bindable(host, port) and reserve(port):
                _handed_out.append(port)
                return port
    return _os_picked_port(host)


def reservation_dir() -> Path:
    """Where this user's processes record the ports they handed out."""
    return Path(tempfile.gettempdir()) / f"miles-ports-{os.getuid()}"


def reserve(port: int, directory: Path | None = None) -> bool:
    """Record `port` as handed out unless another process did so within RESERVATION_S (then False). Where the
    directory cannot be written, True: the per-process memory alone, as before."""
    directory = directory or reservation_dir()
    try:
        directory.mkdir(mode=0o700, exist_ok=True)
        with (directory / ".lock").open("a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # check and record as one step among processes; released on close
            marker = directory / str(port)
            if marker.exists() and time.time() - marker.stat().st_mtime < RESERVATION_S:
                return False
            marker.touch()  # creates it, or sets the mtime of an expired one to now
            return True
    except OSError:
        return True


def _bindable(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
        return True


def _os_picked_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        port = int(sock.getsockname()[1])
    _handed_out.append(port)
    return port
