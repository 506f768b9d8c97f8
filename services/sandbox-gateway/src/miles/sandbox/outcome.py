"""How an exec ended (`ProcessOutcome`) and which limits it ran into (`classify_limits`), for every backend.

Exact where the kernel or the gateway tells us: our own timeout and output cap, the sandbox's cgroup counters
(OOM kills, refused forks), and the exec's own process killed by SIGXCPU, by SIGKILL past the hard CPU limit,
or by SIGXFSZ (a shell's 128+N exit code for a child killed by signal N counts like the signal).
Everything else comes from the last STDERR_TAIL_BYTES of stderr, best-effort and never used for enforcement:
- what a shell (or any program using strsignal) prints when a child was killed by a limit's signal —
  "CPU time limit exceeded", "File size limit exceeded" — and what programs print when a limit refused them —
  "File too large" (EFBIG), Python's MemoryError, a shell's "Cannot fork". These count even when the exec
  succeeded: the shell that reported the death carried on.
- generic errors that other causes produce too ("Cannot allocate memory", EAGAIN from fork in Python): these
  count only when the exec failed.

Not detected: a limit hit by a process whose parent handles the failure silently — Python's subprocess
returning -24 or -25 for a child, a program that catches EFBIG or MemoryError and exits 0 without a word.
Where no cgroup is usable (or on a Kubernetes pod, which reports exit codes only) memory and processes rely on
the messages alone. Cgroup counters are per sandbox, so a concurrent exec's hit shows too.
"""

from __future__ import annotations

import signal
from dataclasses import dataclass

from miles.sandbox.models import LimitKind, Limits

# Printed only when a limit refused something, or a limit's signal killed a process (strsignal's text).
_LIMIT_MESSAGES: dict[LimitKind, tuple[bytes, ...]] = {
    LimitKind.CPU: (b"CPU time limit exceeded",),
    LimitKind.MEMORY: (b"MemoryError", b"std::bad_alloc"),
    LimitKind.PROCESSES: (b"fork: retry", b"fork: Resource temporarily unavailable", b"can't fork", b"Cannot fork"),
    LimitKind.FILE_SIZE: (b"File size limit exceeded", b"File too large"),
}
# Printed for other reasons too: counted only when the exec failed.
_FAILURE_MESSAGES: dict[LimitKind, tuple[bytes, ...]] = {
    LimitKind.MEMORY: (b"Cannot allocate memory", b"out of memory"),
    LimitKind.PROCESSES: (b"BlockingIOError: [Errno 11]",),
}


@dataclass(frozen=True)
class ProcessOutcome:
    """How a process ended: exit_code (-1 when signalled) and signal, plus what the runner observed."""

    exit_code: int
    signal: int
    wall_s: float
    cpu_s: float
    timed_out: bool
    output_capped: bool
    stdout_bytes: int
    stderr_bytes: int
    stderr_tail: bytes


def _ended_by(outcome: ProcessOutcome, signum: int) -> bool:
    return outcome.signal == signum or outcome.exit_code == 128 + signum


def _reported(outcome: ProcessOutcome, kind: LimitKind) -> bool:
    tail = outcome.stderr_tail
    if any(message in tail for message in _LIMIT_MESSAGES.get(kind, ())):
        return True
    return outcome.exit_code != 0 and any(message in tail for message in _FAILURE_MESSAGES.get(kind, ()))


def classify_limits(
    outcome: ProcessOutcome, limits: Limits, *, oom_killed: bool = False, fork_refused: bool = False
) -> tuple[LimitKind, ...]:
    """The limits an exec hit. oom_killed / fork_refused: what the sandbox's cgroups counted during it."""
    hit: list[LimitKind] = []
    if outcome.timed_out:
        hit.append(LimitKind.TIMEOUT)
    killed_by_hard_cpu_limit = (
        outcome.signal == signal.SIGKILL
        and not outcome.timed_out
        and not outcome.output_capped
        and outcome.cpu_s >= limits.cpu_s
    )
    if _ended_by(outcome, signal.SIGXCPU) or killed_by_hard_cpu_limit or _reported(outcome, LimitKind.CPU):
        hit.append(LimitKind.CPU)
    if oom_killed or _reported(outcome, LimitKind.MEMORY):
        hit.append(LimitKind.MEMORY)
    if fork_refused or _reported(outcome, LimitKind.PROCESSES):
        hit.append(LimitKind.PROCESSES)
    if _ended_by(outcome, signal.SIGXFSZ) or _reported(outcome, LimitKind.FILE_SIZE):
        hit.append(LimitKind.FILE_SIZE)
    if outcome.output_capped:
        hit.append(LimitKind.OUTPUT)
    return tuple(hit)
