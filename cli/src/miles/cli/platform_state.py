"""The local platform's records on disk, and how one shared service is started and probed.

`<home>/run/platform.json` (PlatformState: ports, URLs, pids), `<home>/run/<service>.pid`, and
`<home>/run/services.json` (each service's argv and environment, 0600 because the environment holds the
control tokens) from which the keeper restarts a dead service exactly as it was started, on the same ports.
"""

from __future__ import annotations

import json
import socket
import subprocess
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

from miles.common.spawn import ProcessSpec, spawn

SERVICE_ORDER = ("redis", "buffer", "sandbox", "router", "session", "controller")
"""Start order (stop order is the reverse)."""


@dataclass
class ServiceRecord:
    """One running shared service."""

    name: str
    pid: int
    program: str
    """Executable name, checked against /proc/<pid>/cmdline before any signal."""
    url: str
    """What clients use (http://... or redis://... or host:port for gRPC)."""
    ready_url: str
    """HTTP readiness probe ("" for redis: PING)."""
    log_path: str
    restarts: int = 0
    """How often the keeper restarted it since `miles up`."""


@dataclass
class PlatformState:
    """`<home>/run/platform.json`."""

    home: str
    controller_url: str
    started_at_s: float
    services: dict[str, ServiceRecord] = field(default_factory=dict)
    keeper_pid: int = 0
    """The platform keeper (0: none), which restarts dead services; see platform_keeper."""

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)

    @classmethod
    def from_json(cls, text: str) -> PlatformState:
        raw = json.loads(text)
        services = {name: ServiceRecord(**record) for name, record in raw.pop("services").items()}
        return cls(**raw, services=services)


@dataclass(frozen=True)
class Layout:
    """Paths under the platform's home directory (default `.miles` in the working directory)."""

    home: Path

    @property
    def run_dir(self) -> Path:
        return self.home / "run"

    @property
    def log_dir(self) -> Path:
        return self.home / "logs"

    @property
    def state_file(self) -> Path:
        return self.run_dir / "platform.json"

    @property
    def controller_state_dir(self) -> Path:
        return self.home / "controller"

    def pid_file(self, name: str) -> Path:
        return self.run_dir / f"{name}.pid"

    def log_file(self, name: str) -> Path:
        return self.log_dir / f"{name}.log"


def load_state(layout: Layout) -> PlatformState | None:
    if not layout.state_file.is_file():
        return None
    return PlatformState.from_json(layout.state_file.read_text())


def pid_alive(pid: int, program: str) -> bool:
    """The pid runs and its command line still names `program` (guards against recycled pids).

    Read a few times: a process that rewrites its title (redis-server does) briefly shows an empty one."""
    for _ in range(5):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            return False
        if program in cmdline:
            return True
        time.sleep(0.02)
    return False


@dataclass(frozen=True)
class ServiceSpec:
    """How to start one shared service; saved in `<home>/run/services.json` (0600: the env holds tokens) so that
    the keeper restarts it exactly so, on the same ports."""

    name: str
    argv: list[str]
    env: dict[str, str]
    url: str
    ready_url: str


def save_state(layout: Layout, state: PlatformState) -> None:
    """Write platform.json atomically (the keeper and `miles up` both update it)."""
    temporary = layout.state_file.with_suffix(".json.tmp")
    temporary.write_text(state.to_json())
    temporary.replace(layout.state_file)


def save_specs(layout: Layout, specs: list[ServiceSpec], threads_per_process: int) -> None:
    """services.json: how every service was started (read by the keeper to restart one the same way)."""
    path = layout.run_dir / "services.json"
    path.touch(mode=0o600)
    path.chmod(0o600)
    payload = {"threads_per_process": threads_per_process, "services": [asdict(spec) for spec in specs]}
    path.write_text(json.dumps(payload, indent=1))


def load_specs(layout: Layout) -> tuple[dict[str, ServiceSpec], int]:
    """The saved specs by name and the threads setting ({} and 0 when there is no services.json)."""
    path = layout.run_dir / "services.json"
    if not path.is_file():
        return {}, 0
    payload = json.loads(path.read_text())
    specs = {raw["name"]: ServiceSpec(**raw) for raw in payload["services"]}
    return specs, int(payload["threads_per_process"])


def spawn_service(
    layout: Layout, spec: ServiceSpec, threads_per_process: int
) -> tuple[ServiceRecord, subprocess.Popen[bytes]]:
    log_path = layout.log_file(spec.name)
    threads = {"OMP_NUM_THREADS": str(threads_per_process)} if threads_per_process > 0 else {}
    # Its own session (the default): it survives this CLI, and `down` signals its process group.
    process = spawn(ProcessSpec(tuple(spec.argv), log_path, env={**threads, **spec.env}, cwd=Path.cwd()))
    layout.pid_file(spec.name).write_text(f"{process.pid}\n")
    record = ServiceRecord(spec.name, process.pid, Path(spec.argv[0]).name, spec.url, spec.ready_url, str(log_path))
    return record, process


def is_ready(record: ServiceRecord) -> bool:
    if not record.ready_url:
        return _redis_ping(record.url)
    try:
        return httpx.get(record.ready_url, timeout=2.0, trust_env=False).status_code == 200
    except httpx.HTTPError:
        return False


def _redis_ping(url: str) -> bool:
    host_port = url.removeprefix("redis://").split("/", 1)[0]
    host, _, port = host_port.partition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=1.0) as sock:
            sock.sendall(b"PING\r\n")
            return sock.recv(16).startswith(b"+PONG")
    except OSError:
        return False
