"""The local backend's seccomp program, run by a small classic-BPF interpreter (no kernel involved): what it
returns for each architecture, system call and argument. The escape suite checks the same filter in the kernel.

System call numbers in this file come from the kernel headers (asm/unistd_64.h, asm-generic/unistd.h), written
out independently of the table in seccomp.py, so a wrong number there shows up here.
"""

from __future__ import annotations

import errno
import struct

import pytest

from miles.sandbox.local import seccomp

ALLOW = seccomp.RET_ALLOW
KILL = seccomp.RET_KILL_PROCESS
EPERM = seccomp.RET_ERRNO | errno.EPERM
ENOSYS = seccomp.RET_ERRNO | errno.ENOSYS
X86_64, AARCH64 = seccomp.AUDIT_ARCH_X86_64, seccomp.AUDIT_ARCH_AARCH64
AUDIT_ARCH_I386, AUDIT_ARCH_ARM = 0x40000003, 0x40000028

# name: (x86_64, aarch64)
SYSCALL_NUMBERS = {
    "read": (0, 63),
    "write": (1, 64),
    "openat": (257, 56),
    "execve": (59, 221),
    "wait4": (61, 260),
    "clone": (56, 220),
    "clone3": (435, 435),
    "personality": (135, 92),
    "unshare": (272, 97),
    "setns": (308, 268),
    "mount": (165, 40),
    "umount2": (166, 39),
    "pivot_root": (155, 41),
    "fsopen": (430, 430),
    "bpf": (321, 280),
    "perf_event_open": (298, 241),
    "keyctl": (250, 219),
    "add_key": (248, 217),
    "ptrace": (101, 117),
    "process_vm_readv": (310, 270),
    "userfaultfd": (323, 282),
    "io_uring_setup": (425, 425),
    "kexec_load": (246, 104),
    "init_module": (175, 105),
    "reboot": (169, 142),
}
CLONE_NEW_FLAGS = {
    "CLONE_NEWNS": 0x00020000,
    "CLONE_NEWCGROUP": 0x02000000,
    "CLONE_NEWUTS": 0x04000000,
    "CLONE_NEWIPC": 0x08000000,
    "CLONE_NEWUSER": 0x10000000,
    "CLONE_NEWPID": 0x20000000,
    "CLONE_NEWNET": 0x40000000,
}
SIGCHLD = 17
PTHREAD_CREATE_FLAGS = 0x003D0F00  # CLONE_VM|FS|FILES|SIGHAND|THREAD|SYSVSEM|SETTLS|PARENT_SETTID|CHILD_CLEARTID


def run_filter(program: bytes, *, arch: int, nr: int, args: tuple[int, ...] = ()) -> int:
    """What the program returns for one system call (struct seccomp_data built here, little-endian)."""
    data = struct.pack("<iIQ6Q", nr, arch, 0, *args, *([0] * (6 - len(args))))
    instructions = [struct.unpack_from("=HBBI", program, offset) for offset in range(0, len(program), 8)]
    pc, accumulator = 0, 0
    while True:
        code, jt, jf, k = instructions[pc]
        if code == 0x20:  # ld [k]
            accumulator, pc = struct.unpack_from("<I", data, k)[0], pc + 1
        elif code == 0x05:  # ja
            pc += 1 + k
        elif code in (0x15, 0x35, 0x45):  # jeq, jge, jset
            taken = {0x15: accumulator == k, 0x35: accumulator >= k, 0x45: bool(accumulator & k)}[code]
            pc += 1 + (jt if taken else jf)
        elif code == 0x06:  # ret k
            return k
        else:
            raise AssertionError(f"unexpected opcode {code:#x} at {pc}")


@pytest.fixture(scope="module")
def program() -> bytes:
    return seccomp.build_filter()


def call(program: bytes, arch: int, name: str, *args: int) -> int:
    number = SYSCALL_NUMBERS[name][0 if arch == X86_64 else 1]
    return run_filter(program, arch=arch, nr=number, args=args)


@pytest.mark.parametrize("arch", [X86_64, AARCH64])
def test_seccomp_filter_allows_ordinary_system_calls(program: bytes, arch: int) -> None:
    for name in ("read", "write", "openat", "execve", "wait4"):
        assert call(program, arch, name, 3, 0, 0) == ALLOW, name


@pytest.mark.parametrize("arch", [X86_64, AARCH64])
@pytest.mark.parametrize(
    "name",
    [
        "unshare",
        "setns",
        "mount",
        "umount2",
        "pivot_root",
        "fsopen",
        "bpf",
        "perf_event_open",
        "keyctl",
        "add_key",
        "ptrace",
        "process_vm_readv",
        "userfaultfd",
        "io_uring_setup",
        "kexec_load",
        "init_module",
        "reboot",
    ],
)
def test_seccomp_filter_refuses_denied_system_calls_with_eperm(program: bytes, arch: int, name: str) -> None:
    assert call(program, arch, name) == EPERM
    assert call(program, arch, name, 0xFFFFFFFF, 1, 2) == EPERM  # whatever the arguments


def test_every_denied_name_has_a_number_on_x86_64_and_the_portable_ones_on_aarch64() -> None:
    x86_only = {"iopl", "ioperm", "modify_ldt", "uselib"}
    for name in seccomp.DENIED_SYSCALLS:
        assert name in seccomp.X86_64.syscall_numbers, name
        assert (name in seccomp.AARCH64.syscall_numbers) == (name not in x86_only), name


@pytest.mark.parametrize("arch", [X86_64, AARCH64])
def test_clone_with_a_namespace_flag_is_refused_and_fork_and_threads_pass(program: bytes, arch: int) -> None:
    assert call(program, arch, "clone", SIGCHLD) == ALLOW  # fork
    assert call(program, arch, "clone", PTHREAD_CREATE_FLAGS) == ALLOW  # a thread
    assert call(program, arch, "clone", 0xFFFFFFFF_00000000 | SIGCHLD) == ALLOW  # the kernel reads 32 bits only
    for name, flag in CLONE_NEW_FLAGS.items():
        assert call(program, arch, "clone", flag | SIGCHLD) == EPERM, name
        assert call(program, arch, "clone", flag | PTHREAD_CREATE_FLAGS) == EPERM, name


@pytest.mark.parametrize("arch", [X86_64, AARCH64])
def test_clone3_is_enosys_so_that_libc_falls_back_to_clone(program: bytes, arch: int) -> None:
    assert call(program, arch, "clone3", 0x7FFF0000, 88) == ENOSYS


@pytest.mark.parametrize("arch", [X86_64, AARCH64])
def test_personality_may_only_be_queried_or_set_to_the_default(program: bytes, arch: int) -> None:
    assert call(program, arch, "personality", 0xFFFFFFFF) == ALLOW
    assert call(program, arch, "personality", 0) == ALLOW
    assert call(program, arch, "personality", 0x12345678_00000000) == ALLOW  # an unsigned int: high bits ignored
    assert call(program, arch, "personality", 0x0040000) == EPERM  # ADDR_NO_RANDOMIZE
    assert call(program, arch, "personality", 0x0008) == EPERM  # PER_LINUX32
    assert call(program, arch, "personality", 0x0800000) == EPERM  # READ_IMPLIES_EXEC


def test_other_abis_kill_the_process(program: bytes) -> None:
    for arch in (AUDIT_ARCH_I386, AUDIT_ARCH_ARM, 0):
        assert run_filter(program, arch=arch, nr=20) == KILL  # even getpid
    x32_getpid = seccomp.X32_SYSCALL_BIT | 39
    assert run_filter(program, arch=X86_64, nr=x32_getpid) == KILL
    assert run_filter(program, arch=AARCH64, nr=x32_getpid) == ALLOW  # no such ABI there; the kernel says ENOSYS


def test_the_program_fits_the_kernel_limits(program: bytes) -> None:
    assert len(program) % 8 == 0 and len(program) // 8 <= 4096  # BPF_MAXINSNS
    assert seccomp.filter_instructions()[0] == (0x20, 0, 0, 4)  # the architecture is checked first
