"""Escape attempts against the local backend's seccomp filter, through a real gateway process over gRPC.

Each test makes the attempt inside a sandbox and asserts the specific refusal (EPERM, ENOSYS, or SIGSYS for a
foreign ABI), then that the gateway keeps serving. Where the kernel alone would answer differently (EBADF,
EFAULT, EINVAL, or success for calls an unprivileged process may make: keyctl, ptrace of its own child,
userfaultfd, io_uring), the probe uses such arguments, so EPERM proves the filter answered. System call numbers
here are the kernel's (asm/unistd_64.h, asm-generic/unistd.h), independent of seccomp.py's table.
"""

from __future__ import annotations

import json
import platform
import signal
import subprocess
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from conftest import Gateway

pytestmark = [pytest.mark.escape, pytest.mark.integration]

AssertServing = Callable[["Gateway"], None]

PROBE_PRELUDE = r"""
import ctypes, errno, json, os, platform, struct, time
libc = ctypes.CDLL(None, use_errno=True)
ARCH = 0 if platform.machine() == "x86_64" else 1
NUMBERS = {  # name: (x86_64, aarch64)
    "clone": (56, 220), "clone3": (435, 435), "unshare": (272, 97), "setns": (308, 268), "mount": (165, 40),
    "umount2": (166, 39), "pivot_root": (155, 41), "fsopen": (430, 430), "open_tree": (428, 428),
    "bpf": (321, 280), "perf_event_open": (298, 241), "keyctl": (250, 219), "add_key": (248, 217),
    "ptrace": (101, 117), "process_vm_readv": (310, 270), "userfaultfd": (323, 282),
    "io_uring_setup": (425, 425), "personality": (135, 92), "kexec_load": (246, 104), "reboot": (169, 142),
}
KEEP = []
def ptr(data):
    buffer = ctypes.create_string_buffer(data)
    KEEP.append(buffer)
    return ctypes.addressof(buffer)
def syscall(name, *args):
    result = libc.syscall(ctypes.c_long(NUMBERS[name][ARCH]), *(ctypes.c_long(arg) for arg in args))
    return result if result != -1 else errno.errorcode[ctypes.get_errno()]
"""

REFUSED_CALLS = (
    PROBE_PRELUDE
    + r"""
child = os.fork()
if child == 0:
    time.sleep(60)
    os._exit(0)
iov = ptr(struct.pack("<QQ", ptr(bytes(64)), 64))
results = {
    "setns(-1, 0)": syscall("setns", -1, 0),  # EBADF without the filter
    "mount(bad pointers)": syscall("mount", 1, 1, 1, 0, 0),  # EFAULT without
    "umount2(/, bad flags)": syscall("umount2", ptr(b"/"), -1),  # EINVAL without
    "pivot_root(/, /)": syscall("pivot_root", ptr(b"/"), ptr(b"/")),
    "fsopen(tmpfs)": syscall("fsopen", ptr(b"tmpfs"), 0),
    "open_tree(/)": syscall("open_tree", -100, ptr(b"/"), 1),  # OPEN_TREE_CLONE
    "bpf(bad command)": syscall("bpf", 0xFFFF, 0, 0),  # EINVAL without
    "perf_event_open(bad flags)": syscall("perf_event_open", 0, 0, -1, -1, -1),  # EINVAL without
    "keyctl(session keyring id)": syscall("keyctl", 0, -3, 1),  # allowed without
    "add_key(user)": syscall("add_key", ptr(b"user"), ptr(b"k"), ptr(b"v"), 1, -2),  # allowed without
    "ptrace(TRACEME)": syscall("ptrace", 0, 0, 0, 0),  # allowed without
    "ptrace(ATTACH, own child)": syscall("ptrace", 16, child, 0, 0),  # allowed without
    "process_vm_readv(own child)": syscall("process_vm_readv", child, iov, 1, iov, 1, 0),  # allowed without
    "userfaultfd(user mode only)": syscall("userfaultfd", 1),  # allowed without
    "io_uring_setup(1)": syscall("io_uring_setup", 1, ptr(bytes(120))),  # allowed without
    "personality(ADDR_NO_RANDOMIZE)": syscall("personality", 0x0040000),  # allowed without
    "kexec_load": syscall("kexec_load", 0, 0, 0, 0),
    "reboot(bad magic)": syscall("reboot", 0, 0, 0, 0),  # EINVAL without
}
os.kill(child, 9)
os.waitpid(child, 0)
print(json.dumps(results))
"""
)

NEW_USER_NAMESPACE = (
    PROBE_PRELUDE
    + r"""
def new_process(name, *args):
    pid = syscall(name, *args)
    if pid == 0:
        os._exit(0)  # in the new process: leave at once
    if isinstance(pid, int):
        os.waitpid(pid, 0)
        return "created"
    return pid
CLONE_NEWUSER, SIGCHLD = 0x10000000, 17
clone_args = ptr(struct.pack("<8Q", CLONE_NEWUSER, 0, 0, 0, SIGCHLD, 0, 0, 0))
unshare = getattr(os, "unshare", None)  # Python 3.12 and later
try:
    if unshare is not None:
        unshare(CLONE_NEWUSER)
        python_unshare = "unshared"
    else:
        python_unshare = "unshared" if libc.unshare(CLONE_NEWUSER) == 0 else errno.errorcode[ctypes.get_errno()]
except OSError as exc:
    python_unshare = errno.errorcode[exc.errno]
print(json.dumps({
    "unshare(CLONE_NEWUSER)": python_unshare,
    "clone3(CLONE_NEWUSER)": new_process("clone3", clone_args, 64),
    "clone(CLONE_NEWUSER)": new_process("clone", CLONE_NEWUSER | SIGCHLD, 0, 0, 0, 0),
    "clone(SIGCHLD), a plain fork": new_process("clone", SIGCHLD, 0, 0, 0, 0),
    "uid": os.getuid(),
}))
"""
)

INT80_GETPID = r"""
import ctypes, mmap
code = bytes([0xB8, 20, 0, 0, 0, 0xCD, 0x80, 0xC3])  # mov eax, 20 (i386 getpid); int 0x80; ret
page = mmap.mmap(-1, mmap.PAGESIZE, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
page.write(code)
print("survived", ctypes.CFUNCTYPE(ctypes.c_int)(ctypes.addressof(ctypes.c_char.from_buffer(page)))())
"""

X32_GETPID = "import ctypes; ctypes.CDLL(None).syscall(0x40000000 | 39); print('survived')"


def test_escape_nested_user_namespace_is_refused(gateway: Gateway, sandbox: str, assert_serving: AssertServing) -> None:
    outcome = gateway.client.exec(sandbox, shell="unshare -Ur id; unshare -U true; unshare -n true; echo done")
    assert b"uid=0" not in outcome.stdout
    assert outcome.stderr.count(b"unshare failed: Operation not permitted") == 3
    attempts = json.loads(gateway.client.exec(sandbox, argv=["python3", "-c", NEW_USER_NAMESPACE]).text)
    assert attempts == {
        "unshare(CLONE_NEWUSER)": "EPERM",
        "clone3(CLONE_NEWUSER)": "ENOSYS",  # clone3 outright: its flags are out of a filter's reach
        "clone(CLONE_NEWUSER)": "EPERM",
        "clone(SIGCHLD), a plain fork": "created",
        "uid": attempts["uid"],
    }
    assert attempts["uid"] != 0
    assert_serving(gateway)


def test_escape_mount_setns_bpf_keyctl_ptrace_and_friends_are_refused(
    gateway: Gateway, sandbox: str, assert_serving: AssertServing
) -> None:
    outcome = gateway.client.exec(sandbox, argv=["python3", "-c", REFUSED_CALLS])
    assert outcome.result.exit_code == 0, outcome.stderr
    results = json.loads(outcome.text)
    assert results == dict.fromkeys(results, "EPERM")
    assert len(results) == 18
    status = gateway.client.exec(sandbox, shell="grep -E '^(Seccomp|NoNewPrivs):' /proc/self/status /proc/2/status")
    assert status.text.split() == [
        "/proc/self/status:NoNewPrivs:",
        "1",
        "/proc/self/status:Seccomp:",
        "2",  # SECCOMP_MODE_FILTER, in every exec ...
        "/proc/2/status:NoNewPrivs:",
        "1",
        "/proc/2/status:Seccomp:",
        "2",  # ... and in the keeper (bwrap --seccomp)
    ]
    assert_serving(gateway)


@pytest.mark.skipif(platform.machine() != "x86_64", reason="the x32 and i386 ABIs exist on x86_64 only")
def test_escape_32_bit_system_calls_kill_the_process(
    gateway: Gateway, sandbox: str, assert_serving: AssertServing
) -> None:
    x32 = gateway.client.exec(sandbox, argv=["python3", "-c", X32_GETPID])
    assert x32.result.signal == signal.SIGSYS and x32.stdout == b""
    on_host = subprocess.run([sys.executable, "-c", INT80_GETPID], capture_output=True, text=True, check=False)
    if on_host.returncode != 0:
        pytest.skip(f"this kernel runs no i386 system calls (int 0x80 ended with {on_host.returncode})")
    assert on_host.stdout.startswith("survived")  # the same code works outside a sandbox ...
    i386 = gateway.client.exec(sandbox, argv=["python3", "-c", INT80_GETPID])
    assert i386.result.signal == signal.SIGSYS and i386.stdout == b""  # ... and is killed inside
    assert_serving(gateway)


NORMAL_WORK = r"""
import asyncio, json, multiprocessing, os, socket, subprocess, threading

def square(x):
    return x * x

async def echo_over_loopback():
    server = await asyncio.start_server(lambda r, w: w.write(b"pong"), "127.0.0.1", 0)
    reader, writer = await asyncio.open_connection(*server.sockets[0].getsockname()[:2])
    data = await reader.read(4)
    writer.close()
    server.close()
    return data.decode()

threads = [threading.Thread(target=square, args=(n,)) for n in range(16)]
for thread in threads:
    thread.start()
for thread in threads:
    thread.join()
with multiprocessing.Pool(2) as pool:
    pooled = sum(pool.map(square, range(10)))
pipeline = subprocess.run("seq 1 100 | sort -rn | head -3 | tr '\n' ' '", shell=True, capture_output=True, text=True)
with open("/tmp/scratch.txt", "w") as tmp_file, open("work.txt", "w") as work_file:
    tmp_file.write("tmp")
    work_file.write("work")
child = os.fork()
if child == 0:
    os.execvp("true", ["true"])
_, status = os.waitpid(child, 0)
print(json.dumps({
    "threads": len(threads),
    "pool": pooled,
    "pipeline": pipeline.stdout.strip(),
    "files": open("/tmp/scratch.txt").read() + open("work.txt").read(),
    "fork_exec": os.waitstatus_to_exitcode(status),
    "loopback": asyncio.run(echo_over_loopback()),
}))
"""


def test_normal_workloads_still_run_under_the_filter(
    gateway: Gateway, sandbox: str, assert_serving: AssertServing
) -> None:
    outcome = gateway.client.exec(sandbox, argv=["python3", "-c", NORMAL_WORK], timeout_s=60)
    assert outcome.result.exit_code == 0 and outcome.limits_hit == set(), outcome.stderr
    assert json.loads(outcome.text) == {
        "threads": 16,
        "pool": 285,
        "pipeline": "100 99 98",
        "files": "tmpwork",
        "fork_exec": 0,
        "loopback": "pong",
    }
    shell = gateway.client.exec(sandbox, shell="ls / | wc -l; (echo a; echo b) | sort -r | tr -d '\\n'; echo")
    assert shell.result.exit_code == 0 and shell.text.split("\n")[1] == "ba"
    assert_serving(gateway)
