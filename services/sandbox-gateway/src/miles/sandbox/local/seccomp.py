"""The seccomp filter of local sandboxes: a classic-BPF deny list, assembled here with `struct` (no libseccomp).

Why: sandboxes share the host kernel, and without a filter model-written code can reach every system call,
including the usual first steps of kernel exploits: a nested user namespace (`unshare -Ur` makes it "root"
with every capability over new mount, network, ... namespaces), new mounts, eBPF, perf events, io_uring,
userfaultfd, keyrings. The filter refuses those and changes nothing else.

The program (`build_filter`) checks the architecture first: x86_64 and aarch64 get their deny lists, any
other ABI — i386 (`int 0x80` from a 64-bit process) and arm32 compat — kills the process, as do x32 system
calls (x86_64 numbers with bit 30 set): nothing in a 64-bit sandbox uses them, and an errno would leave a
32-bit program unable even to exit. Then, per architecture:
- DENIED_SYSCALLS return EPERM (those missing on an architecture are skipped);
- clone returns EPERM when its flags ask for a new namespace (CLONE_NEW*); plain fork, threads and
  posix_spawn (no namespace flags) pass;
- clone3 returns ENOSYS outright: its flags sit in a struct that a filter cannot read, and on ENOSYS glibc
  falls back to clone (checked above);
- personality returns EPERM except for the default persona (0) and the query (0xffffffff), so a sandbox
  cannot turn off address-space randomisation (ADDR_NO_RANDOMIZE) or pick another execution domain;
- everything else is allowed.

Limits: a deny list, not an allow list. System calls added to the kernel after this list was written are
allowed, and whatever the allowed calls reach (the file systems, the network stack, memory management) stays
as exposed as before. Only the low 32 bits of arguments are inspected (exactly what the kernel reads of clone's
and personality's flags); this relies on both supported architectures being little-endian.
"""

from __future__ import annotations

import errno
import struct
from collections.abc import Mapping
from dataclasses import dataclass

# struct seccomp_data: int nr; __u32 arch; __u64 instruction_pointer; __u64 args[6].
_NR_OFFSET = 0
_ARCH_OFFSET = 4
_ARG0_LOW_OFFSET = 16  # the low 32 bits of args[0] on a little-endian machine

# Classic BPF opcodes (linux/bpf_common.h).
_LD_W_ABS = 0x00 | 0x00 | 0x20  # BPF_LD | BPF_W | BPF_ABS
_JMP_JA = 0x05 | 0x00  # BPF_JMP | BPF_JA
_JMP_JEQ_K = 0x05 | 0x10  # BPF_JMP | BPF_JEQ | BPF_K
_JMP_JGE_K = 0x05 | 0x30  # BPF_JMP | BPF_JGE | BPF_K
_JMP_JSET_K = 0x05 | 0x40  # BPF_JMP | BPF_JSET | BPF_K
_RET_K = 0x06  # BPF_RET | BPF_K

# Return values (linux/seccomp.h).
RET_KILL_PROCESS = 0x80000000
RET_ERRNO = 0x00050000
RET_ALLOW = 0x7FFF0000

AUDIT_ARCH_X86_64 = 0xC000003E
AUDIT_ARCH_AARCH64 = 0xC00000B7
X32_SYSCALL_BIT = 0x40000000

# CLONE_NEWNS | NEWCGROUP | NEWUTS | NEWIPC | NEWUSER | NEWPID | NEWNET. CLONE_NEWTIME (0x80) cannot be passed
# to clone(): there those bits are the exit signal, and the kernel reads only the low 32 bits of the flags.
CLONE_NAMESPACE_FLAGS = 0x00020000 | 0x02000000 | 0x04000000 | 0x08000000 | 0x10000000 | 0x20000000 | 0x40000000
PERSONALITY_DEFAULT = 0x0
PERSONALITY_QUERY = 0xFFFFFFFF

DENIED_SYSCALLS: tuple[str, ...] = (
    # New namespaces and joining others (clone with CLONE_NEW* and clone3 are handled separately).
    "unshare",
    "setns",
    # Mounts, old and new API.
    "mount",
    "umount2",
    "pivot_root",
    "move_mount",
    "open_tree",
    "open_tree_attr",
    "fsopen",
    "fsconfig",
    "fsmount",
    "fspick",
    "mount_setattr",
    # Large kernel attack surface that tool code does not need.
    "bpf",
    "perf_event_open",
    "userfaultfd",
    "io_uring_setup",
    "io_uring_enter",
    "io_uring_register",
    "keyctl",
    "add_key",
    "request_key",
    # Reading or changing other processes (concurrent execs of the same sandbox run as the same uid).
    "ptrace",
    "process_vm_readv",
    "process_vm_writev",
    "pidfd_getfd",
    # Administration: these need capabilities a sandbox never has; refused before the kernel looks further.
    "kexec_load",
    "kexec_file_load",
    "init_module",
    "finit_module",
    "delete_module",
    "acct",
    "swapon",
    "swapoff",
    "reboot",
    "open_by_handle_at",
    "quotactl",
    "quotactl_fd",
    "syslog",
    # x86 only: port I/O, LDT entries, a.out libraries.
    "iopl",
    "ioperm",
    "modify_ldt",
    "uselib",
)


@dataclass(frozen=True)
class Arch:
    """One architecture's audit id and system call numbers (asm/unistd_64.h, asm-generic/unistd.h)."""

    name: str
    audit_arch: int
    syscall_numbers: Mapping[str, int]
    foreign_abi_bit: int | None = None  # numbers with this bit set belong to another ABI (x86_64: x32)


_SHARED_NUMBERS = {
    "io_uring_setup": 425,
    "io_uring_enter": 426,
    "io_uring_register": 427,
    "open_tree": 428,
    "move_mount": 429,
    "fsopen": 430,
    "fsconfig": 431,
    "fsmount": 432,
    "fspick": 433,
    "clone3": 435,
    "pidfd_getfd": 438,
    "mount_setattr": 442,
    "quotactl_fd": 443,
    "open_tree_attr": 467,
}

X86_64 = Arch(
    name="x86_64",
    audit_arch=AUDIT_ARCH_X86_64,
    foreign_abi_bit=X32_SYSCALL_BIT,
    syscall_numbers={
        **_SHARED_NUMBERS,
        "clone": 56,
        "ptrace": 101,
        "syslog": 103,
        "uselib": 134,
        "personality": 135,
        "modify_ldt": 154,
        "pivot_root": 155,
        "acct": 163,
        "mount": 165,
        "umount2": 166,
        "swapon": 167,
        "swapoff": 168,
        "reboot": 169,
        "iopl": 172,
        "ioperm": 173,
        "init_module": 175,
        "delete_module": 176,
        "quotactl": 179,
        "kexec_load": 246,
        "add_key": 248,
        "request_key": 249,
        "keyctl": 250,
        "unshare": 272,
        "perf_event_open": 298,
        "open_by_handle_at": 304,
        "setns": 308,
        "process_vm_readv": 310,
        "process_vm_writev": 311,
        "finit_module": 313,
        "kexec_file_load": 320,
        "bpf": 321,
        "userfaultfd": 323,
    },
)

AARCH64 = Arch(
    name="aarch64",
    audit_arch=AUDIT_ARCH_AARCH64,
    syscall_numbers={
        **_SHARED_NUMBERS,
        "umount2": 39,
        "mount": 40,
        "pivot_root": 41,
        "quotactl": 60,
        "acct": 89,
        "personality": 92,
        "unshare": 97,
        "kexec_load": 104,
        "init_module": 105,
        "delete_module": 106,
        "syslog": 116,
        "ptrace": 117,
        "reboot": 142,
        "add_key": 217,
        "request_key": 218,
        "keyctl": 219,
        "clone": 220,
        "swapon": 224,
        "swapoff": 225,
        "perf_event_open": 241,
        "open_by_handle_at": 265,
        "setns": 268,
        "process_vm_readv": 270,
        "process_vm_writev": 271,
        "finit_module": 273,
        "bpf": 280,
        "userfaultfd": 282,
        "kexec_file_load": 294,
    },
)

ARCHES: tuple[Arch, ...] = (X86_64, AARCH64)

Instruction = tuple[int, int, int, int]  # struct sock_filter: code, jt, jf, k


def _ld(offset: int) -> Instruction:
    return (_LD_W_ABS, 0, 0, offset)


def _ret(value: int) -> Instruction:
    return (_RET_K, 0, 0, value)


def _errno(code: int) -> Instruction:
    return _ret(RET_ERRNO | code)


def _jump(opcode: int, value: int, *, if_true: int, if_false: int) -> Instruction:
    """A conditional jump; if_true / if_false count instructions to skip (0 = the next one)."""
    return (opcode, if_true, if_false, value)


def _rules(arch: Arch) -> list[Instruction]:
    """The checks of one architecture. Each expects the syscall number in A and ends in a return when it
    matches, so a rule that loads an argument never hands a changed A to the next one."""
    numbers = arch.syscall_numbers
    program: list[Instruction] = []
    for name in DENIED_SYSCALLS:
        if name in numbers:
            program += [_jump(_JMP_JEQ_K, numbers[name], if_true=0, if_false=1), _errno(errno.EPERM)]
    program += [_jump(_JMP_JEQ_K, numbers["clone3"], if_true=0, if_false=1), _errno(errno.ENOSYS)]
    program += [
        _jump(_JMP_JEQ_K, numbers["clone"], if_true=0, if_false=4),
        _ld(_ARG0_LOW_OFFSET),
        _jump(_JMP_JSET_K, CLONE_NAMESPACE_FLAGS, if_true=0, if_false=1),
        _errno(errno.EPERM),
        _ret(RET_ALLOW),
    ]
    program += [
        _jump(_JMP_JEQ_K, numbers["personality"], if_true=0, if_false=5),
        _ld(_ARG0_LOW_OFFSET),
        _jump(_JMP_JEQ_K, PERSONALITY_DEFAULT, if_true=2, if_false=0),
        _jump(_JMP_JEQ_K, PERSONALITY_QUERY, if_true=1, if_false=0),
        _errno(errno.EPERM),
        _ret(RET_ALLOW),
    ]
    return [*program, _ret(RET_ALLOW)]


def _arch_block(arch: Arch) -> list[Instruction]:
    block = [_ld(_NR_OFFSET)]
    if arch.foreign_abi_bit is not None:
        block += [_jump(_JMP_JGE_K, arch.foreign_abi_bit, if_true=0, if_false=1), _ret(RET_KILL_PROCESS)]
    return block + _rules(arch)


def filter_instructions(arches: tuple[Arch, ...] = ARCHES) -> list[Instruction]:
    """The whole program: dispatch on the architecture, then that architecture's block; others are killed."""
    blocks = [_arch_block(arch) for arch in arches]
    program: list[Instruction] = [_ld(_ARCH_OFFSET)]
    block_start = 1 + 2 * len(arches) + 1  # after: load arch, a JEQ + JA per architecture, kill
    for arch, block in zip(arches, blocks, strict=True):
        program.append(_jump(_JMP_JEQ_K, arch.audit_arch, if_true=0, if_false=1))
        program.append((_JMP_JA, 0, 0, block_start - (len(program) + 1)))  # JA skips k instructions
        block_start += len(block)
    program.append(_ret(RET_KILL_PROCESS))
    for block in blocks:
        program += block
    return program


def build_filter(arches: tuple[Arch, ...] = ARCHES) -> bytes:
    """The program as bwrap's --seccomp and PR_SET_SECCOMP take it: struct sock_filter[], native byte order."""
    instructions = filter_instructions(arches)
    for code, jt, jf, k in instructions:
        if not (0 <= jt <= 0xFF and 0 <= jf <= 0xFF and 0 <= k <= 0xFFFFFFFF):
            raise ValueError(f"seccomp instruction out of range: {(code, jt, jf, k)}")
    return b"".join(struct.pack("=HBBI", *instruction) for instruction in instructions)
