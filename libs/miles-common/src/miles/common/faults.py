"""Crash points for fault-injection tests: named places where a test can make a process die like `kill -9`.

Production code calls `crash_point(name, key)` at a few places where a crash matters (between a durable
checkpoint and its acks, in the middle of a weight publish, ...). It does nothing unless the process was started
with `MILES_FAULTS` naming that point: a comma-separated list of `<name>` (crash the first time) or
`<name>=<key>` (crash when reached with that key, e.g. a step or version number). Then the process exits at once
with status 137 and without cleanup (`os._exit`), as SIGKILL would leave it. With `MILES_FAULTS_ONCE_DIR` set,
each point fires at most once across every process sharing that directory (a marker file is created first), so
that a supervisor's restart of the crashed process — which inherits the same environment — runs on.

Kept apart from settings on purpose: no service setting can arm a crash, and a production deployment never sets
`MILES_FAULTS`. The list is read once per process.
"""

from __future__ import annotations

import functools
import logging
import os
import sys

FAULTS_ENV = "MILES_FAULTS"
ONCE_DIR_ENV = "MILES_FAULTS_ONCE_DIR"
CRASH_EXIT_CODE = 137

log = logging.getLogger(__name__)


@functools.cache
def _armed() -> dict[str, str | None]:
    armed: dict[str, str | None] = {}
    for item in os.environ.get(FAULTS_ENV, "").split(","):
        name, sep, key = item.strip().partition("=")
        if name:
            armed[name] = key if sep else None
    return armed


def crash_point(name: str, key: object = None) -> None:
    """Exit like kill -9 when `MILES_FAULTS` arms `name` (for `key`, when the entry names one)."""
    armed = _armed()
    if name not in armed:
        return
    wanted = armed[name]
    if wanted is not None and str(key) != wanted:
        return
    once_dir = os.environ.get(ONCE_DIR_ENV)
    if once_dir:
        try:
            marker = os.path.join(once_dir, f"{name}={wanted or ''}.fired")
            os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            return
    log.warning("fault injection: crashing at %s (key %s)", name, key)
    sys.stderr.flush()
    os._exit(CRASH_EXIT_CODE)
