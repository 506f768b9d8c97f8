"""What a benchmark result ran on: every file under bench/results/ records it, so that figures from different machines
are never compared as if they were one run."""

from __future__ import annotations

import os
import platform
from pathlib import Path
from typing import Any

_CPUINFO = Path("/proc/cpuinfo")
_MEMINFO = Path("/proc/meminfo")


def _cpu_model() -> str:
    if _CPUINFO.is_file():
        for line in _CPUINFO.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def _memory_gib() -> float | None:
    if _MEMINFO.is_file():
        for line in _MEMINFO.read_text().splitlines():
            if line.startswith("MemTotal:"):
                return round(int(line.split()[1]) / 2**20, 1)
    return None


def describe_machine() -> dict[str, Any]:
    """Python, OS, the CPUs this process may use (affinity, not the host's count), CPU model and memory."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 0)
    return {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpus": cpus,
        "cpu_model": _cpu_model(),
        "memory_gib": _memory_gib(),
    }
