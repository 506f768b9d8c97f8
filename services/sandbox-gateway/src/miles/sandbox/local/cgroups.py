"""Per-sandbox memory and pids cgroups (v1 or v2, per controller), below the gateway's own cgroup.

Layout: <gateway's cgroup>/miles-sandbox-<gateway pid>/<sandbox id>, in every hierarchy that has the memory or
pids controller. Found from /proc/self/mountinfo and /proc/self/cgroup, so it works in containers whose
cgroup is delegated to them. Cgroup v2 forbids processes in a cgroup that delegates controllers to children:
when the gateway's own v2 cgroup holds processes, the gateway first moves itself into a leaf
(<own>/miles-gateway). Anything that fails makes the controller unusable: the backend then relies on rlimits
alone (mode "auto") or refuses to start (mode "require"). Stale directories of dead gateways are removed at
start-up.

Limits: counters are per sandbox, not per exec; the memory controller charges page cache and tmpfs too.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

CONTROLLERS = ("memory", "pids")
_PREFIX = "miles-sandbox-"


@dataclass(frozen=True)
class CgroupCounters:
    """Monotonic counters of one sandbox cgroup (0 where a controller is not in use)."""

    oom_kills: int = 0
    memory_limit_hits: int = 0
    pids_limit_hits: int = 0


@dataclass(frozen=True)
class Controller:
    """One controller's hierarchy: `base` holds the per-sandbox directories."""

    name: str
    version: int
    base: Path


def _read_keyed(path: Path) -> dict[str, int]:
    """A flat keyed file ("oom_kill 3\\nmax 0") as a dict; {} when missing."""
    try:
        text = path.read_text()
    except OSError:
        return {}
    values: dict[str, int] = {}
    for line in text.splitlines():
        key, _, value = line.partition(" ")
        with contextlib.suppress(ValueError):
            values[key] = int(value)
    return values


def _read_int(path: Path) -> int:
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return 0


def own_cgroup_dirs(proc_root: Path = Path("/proc")) -> dict[str, tuple[int, Path]]:
    """For memory and pids: (cgroup version, directory of this process's cgroup), where mounted."""
    memberships: dict[str, str] = {}
    v2_path: str | None = None
    for line in (proc_root / "self" / "cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if controllers == "":
            v2_path = path
        for name in controllers.split(","):
            memberships[name] = path
    found: dict[str, tuple[int, Path]] = {}
    for line in (proc_root / "self" / "mountinfo").read_text().splitlines():
        fields, _, tail = line.partition(" - ")
        parts, tail_parts = fields.split(), tail.split()
        if len(parts) < 5 or len(tail_parts) < 3:
            continue
        mount_root, mount_point, fstype, super_options = parts[3], parts[4], tail_parts[0], tail_parts[2]
        if fstype == "cgroup":
            for name in CONTROLLERS:
                if name in super_options.split(",") and name in memberships and name not in found:
                    found[name] = (1, Path(mount_point) / _relative(memberships[name], mount_root))
        elif fstype == "cgroup2" and v2_path is not None:
            own = Path(mount_point) / _relative(v2_path, mount_root)
            available = _controllers_file(own)
            for name in CONTROLLERS:
                if name in available and name not in found:
                    found[name] = (2, own)
    return found


def _relative(path: str, mount_root: str) -> str:
    path = path.removeprefix(mount_root.rstrip("/")) if mount_root != "/" else path
    return path.lstrip("/")


def _controllers_file(directory: Path) -> set[str]:
    try:
        return set((directory / "cgroup.controllers").read_text().split())
    except OSError:
        return set()


def _prepare_v2(own: Path, name: str) -> Path:
    """Delegate `name` below `own` (moving the gateway into a leaf first when needed); returns our base dir."""
    subtree = own / "cgroup.subtree_control"
    if name not in subtree.read_text().split():
        try:
            subtree.write_text(f"+{name}")
        except OSError:
            leaf = own / "miles-gateway"
            leaf.mkdir(exist_ok=True)
            (leaf / "cgroup.procs").write_text(str(os.getpid()))
            subtree.write_text(f"+{name}")
    base = own / f"{_PREFIX}{os.getpid()}"
    base.mkdir(exist_ok=True)
    base_subtree = base / "cgroup.subtree_control"
    if name not in base_subtree.read_text().split():
        base_subtree.write_text(f"+{name}")
    return base


def _prepare_v1(own: Path) -> Path:
    base = own / f"{_PREFIX}{os.getpid()}"
    base.mkdir(exist_ok=True)
    return base


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _kill_procs(directory: Path) -> None:
    """SIGKILL every process listed in a cgroup directory."""
    try:
        pids = [int(pid) for pid in (directory / "cgroup.procs").read_text().split()]
    except (OSError, ValueError):
        return
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)


def _remove_tree(directory: Path, attempts: int = 20) -> bool:
    """rmdir a cgroup and its children once their processes are gone (killed here, then retried)."""
    for attempt in range(attempts):
        for child in sorted((p for p in directory.glob("*") if p.is_dir()), reverse=True):
            _kill_procs(child)
            with contextlib.suppress(OSError):
                child.rmdir()
        _kill_procs(directory)
        try:
            directory.rmdir()
            return True
        except FileNotFoundError:
            return True
        except OSError:
            time.sleep(0.005 * (attempt + 1))
    return False


def sweep_stale(own: Path) -> None:
    """Remove miles-sandbox-<pid> directories left by gateways that are gone."""
    for directory in own.glob(f"{_PREFIX}*"):
        pid_text = directory.name.removeprefix(_PREFIX)
        if pid_text.isdigit() and not _pid_alive(int(pid_text)):
            log.info("removing stale sandbox cgroup", extra={"path": str(directory)})
            _remove_tree(directory)


class SandboxCgroup:
    """The cgroup directories of one sandbox (one per usable controller)."""

    def __init__(self, directories: dict[str, tuple[int, Path]]) -> None:
        self.directories = directories

    @property
    def procs_files(self) -> list[str]:
        """cgroup.procs of each directory: a process writes "0" into each to join the sandbox's cgroups."""
        return sorted({str(path / "cgroup.procs") for _, path in self.directories.values()})

    @property
    def has_memory(self) -> bool:
        return "memory" in self.directories

    @property
    def has_pids(self) -> bool:
        return "pids" in self.directories

    def set_memory_limit(self, memory_bytes: int) -> None:
        if "memory" not in self.directories:
            return
        version, path = self.directories["memory"]
        if version == 1:
            (path / "memory.limit_in_bytes").write_text(str(memory_bytes))
            memsw = path / "memory.memsw.limit_in_bytes"
            if memsw.exists():
                # No swap beyond the limit: memsw = memory + swap, so equal values mean zero swap.
                memsw.write_text(str(memory_bytes))
        else:
            (path / "memory.max").write_text(str(memory_bytes))
            swap = path / "memory.swap.max"
            if swap.exists():
                swap.write_text("0")

    def set_pids_limit(self, max_pids: int) -> None:
        if "pids" in self.directories:
            (self.directories["pids"][1] / "pids.max").write_text(str(max_pids))

    def counters(self) -> CgroupCounters:
        oom_kills = memory_hits = pids_hits = 0
        if "memory" in self.directories:
            version, path = self.directories["memory"]
            if version == 1:
                oom_kills = _read_keyed(path / "memory.oom_control").get("oom_kill", 0)
                memory_hits = _read_int(path / "memory.failcnt")
            else:
                events = _read_keyed(path / "memory.events")
                oom_kills, memory_hits = events.get("oom_kill", 0), events.get("max", 0)
        if "pids" in self.directories:
            pids_hits = _read_keyed(self.directories["pids"][1] / "pids.events").get("max", 0)
        return CgroupCounters(oom_kills=oom_kills, memory_limit_hits=memory_hits, pids_limit_hits=pids_hits)

    def kill_all(self) -> None:
        for version, path in self.directories.values():
            kill_file = path / "cgroup.kill"
            if version == 2 and kill_file.exists():
                with contextlib.suppress(OSError):
                    kill_file.write_text("1")
            _kill_procs(path)

    def remove(self) -> bool:
        """Delete the directories (killing what is left); False when one could not be removed yet."""
        return all(_remove_tree(path) for _, path in self.directories.values())


class CgroupManager:
    """The usable controllers of this gateway; makes one SandboxCgroup per sandbox."""

    def __init__(self, controllers: dict[str, Controller]) -> None:
        self.controllers = controllers

    @classmethod
    def detect(cls, proc_root: Path = Path("/proc")) -> CgroupManager:
        """Every controller that can be delegated and written here (possibly none)."""
        usable: dict[str, Controller] = {}
        try:
            dirs = own_cgroup_dirs(proc_root)
        except OSError as exc:
            log.warning("cannot read own cgroups", extra={"error": str(exc)})
            return cls({})
        for name, (version, own) in dirs.items():
            try:
                sweep_stale(own)
                base = _prepare_v1(own) if version == 1 else _prepare_v2(own, name)
                probe = base / "probe"
                probe.mkdir(exist_ok=True)
                if name == "pids":
                    (probe / "pids.max").write_text("100")
                else:
                    (probe / ("memory.limit_in_bytes" if version == 1 else "memory.max")).write_text(str(1 << 30))
                probe.rmdir()
                usable[name] = Controller(name=name, version=version, base=base)
            except OSError as exc:
                log.warning("cgroup controller not usable", extra={"controller": name, "error": str(exc)})
        return cls(usable)

    @property
    def has_memory(self) -> bool:
        return "memory" in self.controllers

    def create(self, sandbox_id: str) -> SandboxCgroup:
        directories: dict[str, tuple[int, Path]] = {}
        for name, controller in self.controllers.items():
            path = controller.base / sandbox_id
            # Under cgroup v2 both controllers share one directory.
            path.mkdir(exist_ok=any(existing == path for _, existing in directories.values()))
            directories[name] = (controller.version, path)
        return SandboxCgroup(directories)

    def close(self) -> None:
        for controller in self.controllers.values():
            _remove_tree(controller.base)
