"""Command lines of the local backend: the bubblewrap "keeper" that holds a sandbox's namespaces, and the chain
that runs one exec inside them.

A sandbox is one long-lived bwrap process tree (the keeper: bwrap's init as pid 1 of a new pid namespace and
a `sleep`), with new mount, pid, net, ipc and uts namespaces, a root made of read-only binds of the template's
system paths, a minimal /dev, a private /proc, a size-bounded tmpfs /tmp and the sandbox's work dir bound
read-write. The keeper runs with every capability dropped and `--die-with-parent`: if the gateway dies, its
sandboxes die with it.

An exec is a chain of exec()s, each doing one thing, started by `processes.stream_process`:

  [sh: join the sandbox's cgroups] -> prlimit (rlimits) -> nsenter (the keeper's namespaces and root; forks
  into the pid namespace) -> setpriv (setuid mode: the sandbox's own uid, no groups, no capabilities, empty
  bounding set; both modes: no_new_privs) -> env -i (clean environment, cwd) -> the command

Everything before setpriv runs as root (setuid mode) with a fixed minimal environment: the caller's env is
applied only by the final `env -i`, after privileges are gone, so variables such as LD_PRELOAD cannot reach a
privileged step. setpriv, env and sh are the sandbox's own (from the template's read-only system paths).

userns mode (unprivileged gateway): the keeper also gets a user namespace mapping the gateway's uid to itself;
nsenter joins it. /dev is built from individual device binds (not bwrap's --dev, whose devpts setup makes bwrap
nest a second user namespace that nsenter could not join).
"""

from __future__ import annotations

import math
import os
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from miles.sandbox.errors import BackendUnusableError
from miles.sandbox.models import ExecSpec, SandboxSpec

INSTALL_HINT = (
    "install it with `apt-get install -y bubblewrap` (Debian/Ubuntu), `dnf install -y bubblewrap` (Fedora/RHEL) "
    "or `apk add bubblewrap` (Alpine); .ci/run installs it on CI"
)
READY_LINE = b"miles-sandbox-ready"
CHAIN_ENV = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LC_ALL": "C"}
_DEVICES = ("null", "zero", "full", "random", "urandom")
_DEV_LINKS = (("/proc/self/fd", "/dev/fd"), ("/proc/self/fd/0", "/dev/stdin"), ("/proc/self/fd/1", "/dev/stdout"))


@dataclass(frozen=True)
class HostTools:
    """Absolute paths of the host binaries the local backend runs (resolved once, at start-up)."""

    bwrap: str
    nsenter: str
    prlimit: str
    sh: str


def find_host_tools(bwrap_path: str) -> HostTools:
    """Resolve bwrap and util-linux tools, or raise BackendUnusableError saying how to install them."""
    bwrap = shutil.which(bwrap_path)
    if bwrap is None:
        raise BackendUnusableError(
            f"bubblewrap (bwrap_path={bwrap_path!r}) was not found: {INSTALL_HINT}. The local sandbox backend "
            "never runs commands unsandboxed; use backend 'kubernetes' or 'remote' where bubblewrap cannot exist.",
            field="bwrap_path",
        )
    found: dict[str, str] = {}
    for name in ("nsenter", "prlimit", "setpriv", "sh"):
        path = shutil.which(name, path=CHAIN_ENV["PATH"])
        if path is None:
            raise BackendUnusableError(f"{name} was not found on the host: `apt-get install -y util-linux` provides it")
        found[name] = path
    return HostTools(bwrap=bwrap, nsenter=found["nsenter"], prlimit=found["prlimit"], sh=found["sh"])


def system_path_args(paths: Sequence[str]) -> list[str]:
    """--ro-bind for directories, --symlink for symlinks (merged-/usr layouts), nothing for missing paths."""
    args: list[str] = []
    for path in paths:
        if os.path.islink(path):
            args += ["--symlink", os.readlink(path), path]
        elif os.path.exists(path):
            args += ["--ro-bind", path, path]
    return args


def dev_args(shm_bytes: int) -> list[str]:
    args = ["--tmpfs", "/dev"]
    for device in _DEVICES:
        args += ["--dev-bind", f"/dev/{device}", f"/dev/{device}"]
    for target, link in (*_DEV_LINKS, ("/proc/self/fd/2", "/dev/stderr")):
        args += ["--symlink", target, link]
    return [*args, "--perms", "1777", "--size", str(shm_bytes), "--tmpfs", "/dev/shm"]


KEEPER_COMMAND = ["/bin/sh", "-c", f"echo {READY_LINE.decode()} && exec sleep infinity"]


def keeper_options(*, spec: SandboxSpec, work_dir: Path, userns: bool, info_fd: int) -> list[str]:
    """bwrap's options for one sandbox's keeper (KEEPER_COMMAND prints READY_LINE once all is set up).

    They reach bwrap through `--args FD`, not its command line: the sandbox can read its pid 1's cmdline, and
    host paths (the work dir's) are none of its business.
    """
    argv: list[str] = []
    if userns:
        argv.append("--unshare-user")
    argv += ["--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts", "--hostname", "sandbox"]
    argv += ["--die-with-parent", "--cap-drop", "ALL"]
    argv += system_path_args(spec.template.system_paths)
    argv += dev_args(spec.template.tmp_bytes)
    argv += ["--proc", "/proc", "--perms", "1777", "--size", str(spec.template.tmp_bytes), "--tmpfs", "/tmp"]
    return [*argv, "--bind", str(work_dir), spec.workdir, "--chdir", "/", "--info-fd", str(info_fd)]


@dataclass(frozen=True)
class ExecLimits:
    """The per-process rlimits of one exec."""

    cpu_s: int
    address_space_bytes: int
    max_processes: int
    max_open_files: int
    max_file_bytes: int


def exec_limits(spec: ExecSpec, *, memory_cgroup: bool, pids_cgroup: bool, address_space_factor: float) -> ExecLimits:
    """rlimits for an exec; the cgroup (when present) is the primary limit, so rlimits then leave it room."""
    limits = spec.limits
    address_space = limits.memory_bytes * (address_space_factor if memory_cgroup else 1.0)
    return ExecLimits(
        cpu_s=max(1, math.ceil(limits.cpu_s)),
        address_space_bytes=int(address_space),
        # One more than the cgroup's limit so that the pids cgroup refuses (and counts) the fork first.
        max_processes=limits.max_processes + (1 if pids_cgroup else 0),
        max_open_files=limits.max_open_files,
        max_file_bytes=limits.max_file_bytes,
    )


def exec_argv(
    tools: HostTools,
    *,
    keeper_pid: int,
    spec: ExecSpec,
    rlimits: ExecLimits,
    uid: int | None,
    cgroup_procs_files: Sequence[str],
) -> list[str]:
    """The chain that runs spec.argv inside the sandbox whose keeper is keeper_pid (uid None = userns mode)."""
    argv: list[str] = []
    if cgroup_procs_files:
        count = len(cgroup_procs_files)
        joins = " && ".join(f'echo 0 > "${index + 1}"' for index in range(count))
        argv += [tools.sh, "-c", f'{joins} && shift {count} && exec "$@"', "sh", *cgroup_procs_files]
    argv += [
        tools.prlimit,
        f"--cpu={rlimits.cpu_s}:{rlimits.cpu_s + 1}",
        f"--as={rlimits.address_space_bytes}",
        f"--nproc={rlimits.max_processes}",
        f"--nofile={rlimits.max_open_files}",
        f"--fsize={rlimits.max_file_bytes}",
        "--core=0",
        "--",
    ]
    argv += [tools.nsenter, f"--target={keeper_pid}", "--mount", "--uts", "--ipc", "--net", "--pid", "--root", "--wd"]
    if uid is None:
        argv += ["--user", "--preserve-credentials"]
    argv += ["--", "setpriv"]
    if uid is not None:
        argv += [f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--inh-caps=-all", "--bounding-set=-all"]
    argv += ["--no-new-privs", "--", "env", "-i", f"--chdir={spec.cwd}", "--"]
    argv += [f"{name}={value}" for name, value in spec.env.items()]
    return [*argv, *spec.argv]
