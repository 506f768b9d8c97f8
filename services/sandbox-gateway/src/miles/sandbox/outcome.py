"""How an exec ended (`ProcessOutcome`) and which limits it ran into (`classify_limits`), for every backend.

Exact where the kernel tells us (cgroup OOM kills and refused forks, SIGXCPU, SIGXFSZ, our own timeout and
output cap). Where it does not — no cgroup, a Kubernetes pod (exit codes only), or a program that handles the
failure itself (Python turns a refused allocation into MemoryError) — a process that ended non-zero with a
telltale message on stderr is flagged: a best-effort signal for the caller, never used for enforcement. A
shell's 128+N exit code for a child killed by signal N counts like the signal. Cgroup counters are per sandbox,
so a concurrent exec's hit shows too.
"""

from __future__ import annotations

import signal
from dataclasses import dataclass

from miles.sandbox.models import LimitKind, Limits

_MEMORY_MESSAGES = (b"MemoryError", b"Cannot allocate memory", b"std::bad_alloc", b"out of memory")
_FORK_MESSAGES = (b"fork: retry", b"fork: Resource temporarily unavailable", b"can't fork")
_FILE_SIZE_MESSAGES = (b"File too large",)


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


def classify_limits(
    outcome: ProcessOutcome, limits: Limits, *, oom_killed: bool = False, fork_refused: bool = False
) -> tuple[LimitKind, ...]:
    """The limits an exec hit. oom_killed / fork_refused: what the sandbox's cgroups counted during it."""
    hit: list[LimitKind] = []
    failed = outcome.exit_code != 0
    tail = outcome.stderr_tail
    if outcome.timed_out:
        hit.append(LimitKind.TIMEOUT)
    killed_by_hard_cpu_limit = (
        outcome.signal == signal.SIGKILL
        and not outcome.timed_out
        and not outcome.output_capped
        and outcome.cpu_s >= limits.cpu_s
    )
    if _ended_by(outcome, signal.SIGXCPU) or killed_by_hard_cpu_limit:
        hit.append(LimitKind.CPU)
    if oom_killed or (failed and any(message in tail for message in _MEMORY_MESSAGES)):
        hit.append(LimitKind.MEMORY)
    if fork_refused or any(message in tail for message in _FORK_MESSAGES):
        hit.append(LimitKind.PROCESSES)
    if _ended_by(outcome, signal.SIGXFSZ) or any(message in tail for message in _FILE_SIZE_MESSAGES):
        hit.append(LimitKind.FILE_SIZE)
    if outcome.output_capped:
        hit.append(LimitKind.OUTPUT)
    return tuple(hit)
