"""Command lines of the local backend: the bubblewrap "keeper" that holds a sandbox's namespaces, and the chain
that runs one exec inside them.

A sandbox is one long-lived bwrap process tree (the keeper: bwrap's init as pid 1 of a new pid namespace and
a `sleep`), with new mount, pid, net, ipc and uts namespaces, a root made of read-only binds of the template's
system paths, a minimal /dev, a private /proc, a size-bounded tmpfs /tmp and the sandbox's work dir bound
read-write. The keeper runs with every capability dropped, the sandbox's seccomp filter (seccomp.py, through
`--seccomp FD`) and `--die-with-parent`: if the gateway dies, its sandboxes die with it.

An exec is a chain of exec()s, each doing one thing, started by `processes.stream_process`:

  python enter.py (join the sandbox's cgroups and the keeper's namespaces and root; fork into the pid
  namespace; rlimits; the seccomp filter) -> setpriv (setuid mode: the sandbox's own uid, no groups, no
  capabilities, empty bounding set; both modes: no_new_privs) -> env -i (clean environment, cwd) -> the command

enter.py replaces nsenter and prlimit: a process that joins namespaces does not inherit the keeper's filter,
so each exec installs it itself, after its setns() calls (see enter.py). Everything before setpriv runs as root
(setuid mode) with a fixed minimal environment: the caller's env is applied only by the final `env -i`, after
privileges are gone, so variables such as LD_PRELOAD cannot reach a privileged step. setpriv, env and sh are
the sandbox's own (from the template's read-only system paths); python and enter.py are the gateway's.

userns mode (unprivileged gateway): the keeper also gets a user namespace mapping the gateway's uid to itself,
and `--disable-userns` where bwrap has it (0.8.0 and later): bwrap then sets user.max_user_namespaces to 1 in
that namespace and nests a second one for the sandbox, so nothing inside can create another user namespace
even past the filter. (setuid mode has no user namespace to limit, and bwrap's --assert-userns-disabled would
fail there: it probes before the filter is installed, as root; the filter alone refuses them.) /dev is built
from individual device binds (not bwrap's --dev, whose devpts setup makes bwrap map the gateway's uid to root in
the outer of two nested user namespaces).
"""

from __future__ import annotations

import math
import os
import shutil
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from miles.sandbox.errors import BackendUnusableError
from miles.sandbox.local.enter import EnterSpec
from miles.sandbox.models import ExecSpec, SandboxSpec

INSTALL_HINT = (
    "install it with `apt-get install -y bubblewrap` (Debian/Ubuntu), `dnf install -y bubblewrap` (Fedora/RHEL) "
    "or `apk add bubblewrap` (Alpine); .ci/run installs it on CI"
)
READY_LINE = b"miles-sandbox-ready"
CHAIN_ENV = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LC_ALL": "C"}
_DEVICES = ("null", "zero", "full", "random", "urandom")
_DEV_LINKS = (("/proc/self/fd", "/dev/fd"), ("/proc/self/fd/0", "/dev/stdin"), ("/proc/self/fd/1", "/dev/stdout"))
ENTER_SCRIPT = str(Path(__file__).with_name("enter.py"))


@dataclass(frozen=True)
class HostTools:
    """What the local backend runs on the host, resolved once at start-up."""

    bwrap: str
    python: str  # the gateway's own interpreter; it runs ENTER_SCRIPT for each exec
    bwrap_disables_userns: bool  # bwrap has --disable-userns (0.8.0 and later)


def _bwrap_options(bwrap: str) -> str:
    """bwrap's --help text (its list of options), or BackendUnusableError."""
    try:
        finished = subprocess.run([bwrap, "--help"], capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise BackendUnusableError(f"could not run {bwrap} --help: {exc}", field="bwrap_path") from None
    return finished.stdout + finished.stderr


def find_host_tools(bwrap_path: str) -> HostTools:
    """Resolve bwrap and check what it supports, or raise BackendUnusableError saying how to install it."""
    bwrap = shutil.which(bwrap_path)
    if bwrap is None:
        raise BackendUnusableError(
            f"bubblewrap (bwrap_path={bwrap_path!r}) was not found: {INSTALL_HINT}. The local sandbox backend "
            "never runs commands unsandboxed; use backend 'kubernetes' or 'remote' where bubblewrap cannot exist.",
            field="bwrap_path",
        )
    options = _bwrap_options(bwrap)
    if "--seccomp" not in options:
        raise BackendUnusableError(f"{bwrap} has no --seccomp option (too old): {INSTALL_HINT}", field="bwrap_path")
    if shutil.which("setpriv", path=CHAIN_ENV["PATH"]) is None:
        raise BackendUnusableError("setpriv was not found on the host: `apt-get install -y util-linux` provides it")
    return HostTools(bwrap=bwrap, python=_runnable_python(), bwrap_disables_userns="--disable-userns" in options)


def _runnable_python() -> str:
    """An interpreter this process may exec for enter.py (standard library only, Python 3.9 or later): its own,
    else python3 on CHAIN_ENV's PATH. sys.executable can be a link this uid may not follow, e.g. a virtualenv
    made by root for a gateway started as another uid."""
    for candidate in (sys.executable, shutil.which("python3", path=CHAIN_ENV["PATH"])):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    raise BackendUnusableError(f"the gateway cannot execute its own interpreter ({sys.executable}) nor python3")


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


def keeper_options(
    *, spec: SandboxSpec, work_dir: Path, userns: bool, disable_userns: bool, info_fd: int, seccomp_fd: int
) -> list[str]:
    """bwrap's options for one sandbox's keeper (KEEPER_COMMAND prints READY_LINE once all is set up).

    They reach bwrap through `--args FD`, not its command line: the sandbox can read its pid 1's cmdline, and
    host paths (the work dir's) are none of its business. seccomp_fd: a pipe holding the filter program.
    """
    argv: list[str] = []
    if userns:
        argv.append("--unshare-user")
        if disable_userns:
            argv.append("--disable-userns")
    argv += ["--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts", "--hostname", "sandbox"]
    argv += ["--die-with-parent", "--cap-drop", "ALL", "--seccomp", str(seccomp_fd)]
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


def enter_spec(
    *,
    keeper_pid: int,
    rlimits: ExecLimits,
    userns: bool,
    cgroup_procs_files: Sequence[str],
    seccomp_program: bytes,
) -> EnterSpec:
    """What enter.py needs to start an exec in the sandbox whose keeper is keeper_pid."""
    cpu_s, address_space, processes = rlimits.cpu_s, rlimits.address_space_bytes, rlimits.max_processes
    return EnterSpec(
        keeper_pid=keeper_pid,
        userns=userns,
        cgroup_procs_files=cgroup_procs_files,
        rlimits={
            "RLIMIT_CPU": (cpu_s, cpu_s + 1),  # SIGXCPU at the limit, SIGKILL a second later
            "RLIMIT_AS": (address_space, address_space),
            "RLIMIT_NPROC": (processes, processes),
            "RLIMIT_NOFILE": (rlimits.max_open_files, rlimits.max_open_files),
            "RLIMIT_FSIZE": (rlimits.max_file_bytes, rlimits.max_file_bytes),
            "RLIMIT_CORE": (0, 0),
        },
        seccomp_program=seccomp_program,
    )


def exec_argv(tools: HostTools, *, spec_fd: int, spec: ExecSpec, uid: int | None) -> list[str]:
    """The chain that runs spec.argv; enter.py reads its EnterSpec from spec_fd (uid None = userns mode)."""
    argv = [tools.python, "-I", "-S", ENTER_SCRIPT, str(spec_fd), "--", "setpriv"]
    if uid is not None:
        argv += [f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--inh-caps=-all", "--bounding-set=-all"]
    argv += ["--no-new-privs", "--", "env", "-i", f"--chdir={spec.cwd}", "--"]
    argv += [f"{name}={value}" for name, value in spec.env.items()]
    return [*argv, *spec.argv]
