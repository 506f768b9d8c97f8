"""Enter a local sandbox and start one exec in it: the step between the gateway and the sandbox's `setpriv`.

The gateway runs this file as a script, `python -I -S enter.py SPEC_FD -- setpriv ...` (`exec_argv` in
bwrap.py builds the line), so it imports nothing but the standard library: -S skips site-packages and keeps the
start quick. It does what nsenter and prlimit did, plus the one thing they cannot: install the sandbox's
seccomp filter *after* joining the namespaces. A process that joins namespaces with setns() does not inherit
the filter of the process it joins (filters pass only from parent to child, so bwrap's --seccomp covers the
keeper alone), and setns is itself refused by the filter, so the filter must come after it, from a program
that started on the host.

The parent (host side; root in setuid mode) reads the EnterSpec from SPEC_FD (a pipe: host paths never show
in the sandbox's /proc), opens the sandbox's cgroup.procs files and the keeper's namespaces and root from the
host's /proc, checks through a pidfd that the keeper is still the same process, joins the namespaces, chroots
into the sandbox's root and forks: only children enter a pid namespace. It then waits and ends like the child
(the same exit code, or killed by the same signal), as nsenter did; it stays outside the sandbox's cgroups.
The child joins the cgroups, restores the SIGPIPE and SIGXFSZ dispositions Python changed at start-up (so a
writer past RLIMIT_FSIZE is killed, as it would be without Python in the chain), sets no_new_privs, installs
the filter, sets the rlimits (last: a small RLIMIT_AS must not fail this Python process) and execs the rest
of the chain. A failure before that exec prints one line on stderr and exits with EXIT_ENTER_FAILED.

User namespaces (userns mode): the keeper may sit in a user namespace nested in the one that owns its other
namespaces (bwrap --disable-userns nests one). setns needs capabilities over a namespace's owner, so the
owning user namespace is joined first, then the others, then the keeper's own.

Limits: it costs one Python start per exec (a few ms of CPU, counted in the exec's cpu_s), and its parent
process holds a few MiB of memory outside the sandbox while the exec runs.
"""

from __future__ import annotations

import ctypes
import fcntl
import os
import resource
import signal
import sys
from collections.abc import Mapping, Sequence

EXIT_ENTER_FAILED = 125
# Joined in this order after any user namespace; the mount namespace last, since joining it changes the root.
NAMESPACES = (("ipc", 0x08000000), ("uts", 0x04000000), ("net", 0x40000000), ("pid", 0x20000000), ("mnt", 0x00020000))
CLONE_NEWUSER = 0x10000000
NS_GET_USERNS = 0xB701  # _IO(0xb7, 0x1): the user namespace that owns a namespace
PR_SET_NO_NEW_PRIVS = 38
PR_SET_SECCOMP = 22
SECCOMP_MODE_FILTER = 2


class EnterSpec:
    """What the gateway tells this script about one exec; sent as text lines, one field per line."""

    def __init__(
        self,
        *,
        keeper_pid: int,
        userns: bool,
        cgroup_procs_files: Sequence[str],
        rlimits: Mapping[str, tuple[int, int]],
        seccomp_program: bytes,
    ) -> None:
        self.keeper_pid = keeper_pid
        self.userns = userns
        self.cgroup_procs_files = tuple(cgroup_procs_files)
        self.rlimits = dict(rlimits)  # resource.RLIMIT_* name -> (soft, hard)
        self.seccomp_program = seccomp_program

    def encode(self) -> bytes:
        lines = [f"keeper_pid {self.keeper_pid}", f"userns {int(self.userns)}"]
        lines += [f"cgroup_procs_file {path}" for path in self.cgroup_procs_files]
        lines += [f"rlimit {name} {soft} {hard}" for name, (soft, hard) in self.rlimits.items()]
        lines.append(f"seccomp_program {self.seccomp_program.hex()}")
        return "".join(f"{line}\n" for line in lines).encode()

    @classmethod
    def decode(cls, data: bytes) -> EnterSpec:
        fields: dict[str, list[str]] = {}
        for line in data.decode().splitlines():
            key, _, value = line.partition(" ")
            fields.setdefault(key, []).append(value)
        rlimits = {}
        for value in fields.get("rlimit", []):
            name, soft, hard = value.split(" ")
            rlimits[name] = (int(soft), int(hard))
        return cls(
            keeper_pid=int(fields["keeper_pid"][0]),
            userns=fields["userns"][0] == "1",
            cgroup_procs_files=fields.get("cgroup_procs_file", []),
            rlimits=rlimits,
            seccomp_program=bytes.fromhex(fields["seccomp_program"][0]),
        )


class _SockFprog(ctypes.Structure):
    """struct sock_fprog: the length of a classic-BPF program (in instructions) and its address."""

    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


def _libc_call(name: str, *args: ctypes.c_int | ctypes.c_ulong | ctypes.c_void_p) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if getattr(libc, name)(*args) != 0:
        code = ctypes.get_errno()
        raise OSError(code, f"{name}: {os.strerror(code)}")


def _setns(fd: int, nstype: int) -> None:
    _libc_call("setns", ctypes.c_int(fd), ctypes.c_int(nstype))


def _same_object(fd_a: int, fd_b: int) -> bool:
    a, b = os.fstat(fd_a), os.fstat(fd_b)
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def enter_namespaces(keeper_pid: int, *, userns: bool) -> None:
    """Join the keeper's namespaces and root (this process; its children then start in the pid namespace)."""
    pidfd = os.pidfd_open(keeper_pid)
    proc = f"/proc/{keeper_pid}"
    root_fd = os.open(f"{proc}/root", os.O_RDONLY | os.O_DIRECTORY)
    fds = {name: os.open(f"{proc}/ns/{name}", os.O_RDONLY) for name, _ in NAMESPACES}
    user_fds: list[int] = []
    if userns:
        owner_fd = fcntl.ioctl(fds["mnt"], NS_GET_USERNS)
        keeper_fd = os.open(f"{proc}/ns/user", os.O_RDONLY)
        user_fds = [owner_fd, keeper_fd]
        if _same_object(owner_fd, keeper_fd):
            os.close(user_fds.pop())
    signal.pidfd_send_signal(pidfd, 0)  # still the same process, so all opened above is the keeper's
    if user_fds:
        _setns(user_fds[0], CLONE_NEWUSER)
    for name, nstype in NAMESPACES:
        _setns(fds[name], nstype)
    for fd in user_fds[1:]:
        _setns(fd, CLONE_NEWUSER)
    os.fchdir(root_fd)
    os.chroot(".")
    for fd in (pidfd, root_fd, *fds.values(), *user_fds):
        os.close(fd)


def install_seccomp(program: bytes) -> None:
    """no_new_privs, then the filter (struct sock_filter[]) for this process and everything it starts."""
    zero = ctypes.c_ulong(0)
    _libc_call("prctl", ctypes.c_int(PR_SET_NO_NEW_PRIVS), ctypes.c_ulong(1), zero, zero, zero)
    buffer = ctypes.create_string_buffer(program, len(program))
    fprog = _SockFprog(len(program) // 8, ctypes.addressof(buffer))
    mode = ctypes.c_ulong(SECCOMP_MODE_FILTER)
    _libc_call("prctl", ctypes.c_int(PR_SET_SECCOMP), mode, ctypes.c_void_p(ctypes.addressof(fprog)), zero, zero)


def _start_child(spec: EnterSpec, cgroup_fds: Sequence[int], argv: list[str]) -> None:
    """In the forked child: cgroups, signals, filter, rlimits, then exec argv (returns only on failure)."""
    for fd in cgroup_fds:
        os.write(fd, b"0")  # "0" is the writing process itself
        os.close(fd)
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    signal.signal(signal.SIGXFSZ, signal.SIG_DFL)
    install_seccomp(spec.seccomp_program)
    for name, limits in spec.rlimits.items():
        resource.setrlimit(getattr(resource, name), limits)
    _exec_on_path(argv)


def _exec_on_path(argv: list[str]) -> None:
    """execvp without os.execvp, which imports a module lazily: after the chroot no module can be imported."""
    error: OSError = FileNotFoundError(f"{argv[0]} not found on PATH")
    for directory in os.environ.get("PATH", "/usr/bin:/bin").split(":"):
        try:
            os.execv(f"{directory}/{argv[0]}", argv)
        except (FileNotFoundError, NotADirectoryError):
            continue
        except OSError as exc:
            error = exc
    raise error


def _end_like(status: int) -> None:
    """Exit as the child did: the same code, or killed by the same signal."""
    if os.WIFSIGNALED(status):
        signum = os.WTERMSIG(status)
        if signum not in (signal.SIGKILL, signal.SIGSTOP):
            signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
        os._exit(128 + signum)  # only reached for a signal whose default action does not end a process
    os._exit(os.waitstatus_to_exitcode(status))


def main() -> None:
    spec_fd, separator, *argv = sys.argv[1:]
    if separator != "--" or not argv:
        raise SystemExit("usage: enter.py SPEC_FD -- COMMAND...")
    with os.fdopen(int(spec_fd), "rb") as spec_file:
        spec = EnterSpec.decode(spec_file.read())
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # _end_like may re-raise a core-dumping signal here
    cgroup_fds = [os.open(path, os.O_WRONLY) for path in spec.cgroup_procs_files]
    enter_namespaces(spec.keeper_pid, userns=spec.userns)
    child = os.fork()
    if child == 0:
        try:
            _start_child(spec, cgroup_fds, argv)
        except BaseException as exc:  # anything here means the command never started
            os.write(2, f"miles-sandbox: cannot start {argv[0]}: {exc}\n".encode(errors="replace"))
        os._exit(EXIT_ENTER_FAILED)
    for fd in cgroup_fds:
        os.close(fd)
    _, status = os.waitpid(child, 0)
    _end_like(status)


if __name__ == "__main__":
    try:
        main()
    except OSError as exc:
        sys.stderr.write(f"miles-sandbox: cannot enter the sandbox: {exc}\n")
        sys.exit(EXIT_ENTER_FAILED)
