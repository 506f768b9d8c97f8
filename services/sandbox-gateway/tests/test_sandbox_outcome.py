"""classify_limits, one limit at a time: what the kernel or the gateway reports exactly, what a shell or program
prints about it, and what must not count."""

from __future__ import annotations

import signal
from dataclasses import replace

import pytest

from miles.sandbox.models import LimitKind, Limits
from miles.sandbox.outcome import ProcessOutcome, classify_limits

LIMITS = Limits(cpu_s=2.0, memory_bytes=1 << 30, max_processes=8, max_open_files=64, max_file_bytes=1 << 20)
CLEAN = ProcessOutcome(
    exit_code=0,
    signal=0,
    wall_s=0.1,
    cpu_s=0.05,
    timed_out=False,
    output_capped=False,
    stdout_bytes=0,
    stderr_bytes=0,
    stderr_tail=b"",
)


def limits_of(**changes: object) -> set[LimitKind]:
    return set(classify_limits(replace(CLEAN, **changes), LIMITS))  # type: ignore[arg-type]


def test_a_clean_exit_hits_no_limit() -> None:
    assert limits_of() == set()
    assert limits_of(exit_code=1, stderr_tail=b"error: something else\n") == set()


def test_timeout_is_what_the_gateway_observed() -> None:
    assert limits_of(timed_out=True, exit_code=-1, signal=signal.SIGKILL, cpu_s=5.0) == {LimitKind.TIMEOUT}


def test_output_cap_is_what_the_gateway_observed() -> None:
    assert limits_of(output_capped=True, exit_code=-1, signal=signal.SIGKILL, cpu_s=5.0) == {LimitKind.OUTPUT}


@pytest.mark.parametrize(
    "changes",
    [
        {"exit_code": -1, "signal": signal.SIGXCPU},
        {"exit_code": 128 + signal.SIGXCPU},  # a shell whose last command was killed
        {"exit_code": -1, "signal": signal.SIGKILL, "cpu_s": 2.5},  # past the hard limit (SIGXCPU ignored)
        {"stderr_tail": b"CPU time limit exceeded\nafter\n"},  # a shell reported a child's death and carried on
    ],
)
def test_cpu_limit(changes: dict[str, object]) -> None:
    assert limits_of(**changes) == {LimitKind.CPU}


@pytest.mark.parametrize(
    "changes",
    [
        {"exit_code": -1, "signal": signal.SIGXFSZ},
        {"exit_code": 128 + signal.SIGXFSZ},
        {"stderr_tail": b"File size limit exceeded\ndone\n"},  # a shell reported a child's death and carried on
        {"exit_code": 1, "stderr_tail": b"OSError: [Errno 27] File too large\n"},  # EFBIG where SIGXFSZ is ignored
        {"stderr_tail": b"head: error writing 'out': File too large\n"},
    ],
)
def test_file_size_limit(changes: dict[str, object]) -> None:
    assert limits_of(**changes) == {LimitKind.FILE_SIZE}


@pytest.mark.parametrize(
    "changes",
    [
        {"exit_code": 1, "stderr_tail": b"MemoryError\n"},
        {"stderr_tail": b"Traceback ...\nMemoryError\nafter\n"},  # in a shell that carried on
        {"exit_code": 134, "stderr_tail": b"terminate called after throwing an instance of 'std::bad_alloc'\n"},
        {"exit_code": 1, "stderr_tail": b"mmap: Cannot allocate memory\n"},
    ],
)
def test_memory_limit_from_messages(changes: dict[str, object]) -> None:
    assert limits_of(**changes) == {LimitKind.MEMORY}


def test_memory_limit_from_the_cgroup_oom_counter() -> None:
    killed = replace(CLEAN, exit_code=-1, signal=signal.SIGKILL)
    assert set(classify_limits(killed, LIMITS, oom_killed=True)) == {LimitKind.MEMORY}


@pytest.mark.parametrize(
    "changes",
    [
        {"exit_code": 2, "stderr_tail": b"/bin/sh: 0: Cannot fork\n"},
        {"stderr_tail": b"bash: fork: retry: Resource temporarily unavailable\n"},
        {"exit_code": 1, "stderr_tail": b"BlockingIOError: [Errno 11] Resource temporarily unavailable\n"},
    ],
)
def test_process_limit_from_messages(changes: dict[str, object]) -> None:
    assert limits_of(**changes) == {LimitKind.PROCESSES}


def test_process_limit_from_the_cgroup_counter() -> None:
    assert set(classify_limits(CLEAN, LIMITS, fork_refused=True)) == {LimitKind.PROCESSES}


def test_generic_messages_count_only_when_the_exec_failed() -> None:
    assert limits_of(stderr_tail=b"warning: out of memory for the cache, continuing\n") == set()
    assert limits_of(stderr_tail=b"BlockingIOError: [Errno 11] Resource temporarily unavailable\n") == set()


def test_a_sigkill_below_the_cpu_limit_is_no_cpu_hit() -> None:
    assert limits_of(exit_code=-1, signal=signal.SIGKILL, cpu_s=0.5) == set()
