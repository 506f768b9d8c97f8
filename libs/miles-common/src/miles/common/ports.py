"""Free TCP ports picked by the OS, for processes started on this machine (`miles up`, the local backend, tests)."""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on `host` that was free a moment ago (the OS picks it).

    Limit: the port is released before the caller's process binds it, so another process may take it in between;
    rare on loopback, and the caller sees it as a failed start-up."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])
