"""The local platform behind `miles up` / `miles down`: the shared services as detached processes on 127.0.0.1.

What it starts, in order: redis-server (AOF on, data under `<home>/redis/`), the buffer, the sandbox gateway and
the rollout router, then the session server (it needs the router), then the controller with the local backend
(it needs all of them). Each process runs in its own session (it outlives the `miles up` that started it), logs
to `<home>/logs/<service>.log`, and has a pid file `<home>/run/<service>.pid`; `<home>/run/platform.json` records
ports, URLs and pids, which every other `miles` command reads to find the controller. Ports are free loopback
ports chosen at start-up, so several platforms (and test runs) coexist on one machine. Each service gets its
settings as `MILES_<SERVICE>_*` variables and is started by miles.common.spawn, the same policy as the
controller's per-job processes.

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

import signal
import subprocess
import time
from collections.abc import Callable

from miles.cli.platform_keeper import heal_platform, start_keeper, stop_keeper
from miles.cli.platform_state import (
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
from miles.cli.platform_tokens import SESSION_OPERATOR, generate_tokens
from miles.common.ports import free_port
from miles.common.spawn import SettingValue, console_script, redis_server_binary, settings_env, signal_process

__all__ = [
    "SERVICE_ORDER",
    "Layout",
    "PlatformError",
    "PlatformState",
    "ServiceRecord",
    "ensure_platform",
    "load_state",
    "pid_alive",
    "service_health",
    "start_platform",
    "stop_platform",
]


class PlatformError(RuntimeError):
    """The platform cannot be started, found or stopped as asked."""


def venv_script(name: str) -> str:
    """A service's console script (installed beside `miles` by `make setup`)."""
    try:
        return console_script(name)
    except FileNotFoundError as exc:
        raise PlatformError(str(exc)) from None


def redis_binary() -> str:
    try:
        return redis_server_binary()
    except FileNotFoundError as exc:
        raise PlatformError(str(exc)) from None


SERVICE_SCRIPTS = {
    "buffer": "miles-buffer",
    "sandbox": "miles-sandbox-gateway",
    "router": "miles-rollout-router",
    "session": "miles-session-server",
    "controller": "miles-controller",
}
"""The console script of every shared service but redis, in start order (the settings prefix is the upper-cased
name: MILES_BUFFER_ ...)."""


def _addresses(ports: dict[str, int]) -> dict[str, str]:
    """What clients use to reach each port: URLs for HTTP and Redis, host:port for gRPC."""
    return {
        "redis": f"redis://127.0.0.1:{ports['redis']}/0",
        "buffer": f"127.0.0.1:{ports['buffer']}",
        "buffer_http": f"http://127.0.0.1:{ports['buffer_metrics']}",
        "sandbox": f"127.0.0.1:{ports['sandbox']}",
        "sandbox_http": f"http://127.0.0.1:{ports['sandbox_http']}",
        "router": f"http://127.0.0.1:{ports['router']}",
        "router_admin": f"127.0.0.1:{ports['router_admin']}",
        "session": f"http://127.0.0.1:{ports['session']}",
        "controller": f"http://127.0.0.1:{ports['controller']}",
    }


def _service_settings(
    layout: Layout, ports: dict[str, int], address: dict[str, str], tokens: dict[str, str]
) -> dict[str, dict[str, SettingValue]]:
    """Each service's settings (field → value), handed to it as MILES_<SERVICE>_* variables."""
    home = layout.home.resolve()
    plain: dict[str, SettingValue] = {"log_json": False}
    operator_token = tokens[SESSION_OPERATOR]
    return {
        "buffer": {
            **plain,
            "redis_url": address["redis"],
            "port": ports["buffer"],
            "metrics_port": ports["buffer_metrics"],
            "operator_token": tokens["buffer_operator"],
        },
        "sandbox": {
            **plain,
            "port": ports["sandbox"],
            "metrics_port": ports["sandbox_http"],
            "state_dir": home / "sandbox",
            "operator_token": tokens["sandbox_operator"],
        },
        "router": {
            **plain,
            "port": ports["router"],
            "admin_grpc_port": ports["router_admin"],
            "admin_token": tokens["router_admin"],
            "engine_api_key": tokens["engine_api_key"],
        },
        "session": {
            **plain,
            "port": ports["session"],
            "redis_url": address["redis"],
            "upstream_url": address["router"],
            "operator_token": operator_token,
        },
        "controller": {
            **plain,
            "port": ports["controller"],
            "redis_url": address["redis"],
            "backend": "local",
            "state_dir": layout.controller_state_dir.resolve(),
            "router_url": address["router"],
            "router_admin_address": address["router_admin"],
            "session_url": address["session"],
            "session_operator_token": operator_token,
            "router_admin_token": tokens["router_admin"],
            "buffer_operator_token": tokens["buffer_operator"],
            "engine_admin_api_key": tokens["engine_admin_api_key"],
            "engine_api_key": tokens["engine_api_key"],
            "weightsync_auth_token": tokens["weightsync"],
            "trainer_auth_token": tokens["trainer"],
            "sandbox_operator_token": tokens["sandbox_operator"],
            "buffer_address": address["buffer"],
            "sandbox_address": address["sandbox"],
            "sandbox_http_url": address["sandbox_http"],
            "observe_interval_s": 1.0,
        },
    }


def _service_specs(layout: Layout, ports: dict[str, int], tokens: dict[str, str]) -> list[ServiceSpec]:
    address = _addresses(ports)
    settings = _service_settings(layout, ports, address, tokens)
    probe = {**address, "buffer": address["buffer_http"], "sandbox": address["sandbox_http"]}
    redis_argv = [
        *(redis_binary(), "--port", str(ports["redis"]), "--bind", "127.0.0.1", "--save", ""),
        *("--appendonly", "yes", "--appendfsync", "everysec", "--dir", str(layout.home.resolve() / "redis")),
        *("--daemonize", "no", "--protected-mode", "yes"),
    ]
    specs = [ServiceSpec("redis", redis_argv, {}, address["redis"], "")]
    for name, script in SERVICE_SCRIPTS.items():
        env = settings_env(name.upper(), settings[name])
        specs.append(ServiceSpec(name, [venv_script(script)], env, address[name], f"{probe[name]}/readyz"))
    return specs


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
            if process.poll() is None:
                signal_process(process.pid, signal.SIGKILL)
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
            signal_process(record.pid, signal.SIGTERM)
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
            signal_process(record.pid, signal.SIGKILL)


def service_health(record: ServiceRecord) -> str:
    """`ready`, `not ready` (running, probe failing) or `stopped`."""
    if not pid_alive(record.pid, record.program):
        return "stopped"
    return "ready" if is_ready(record) else "not ready"
