"""Crash points: inert unless MILES_FAULTS arms them; armed, they end the process like kill -9 (status 137), for
the named key only, and at most once per MILES_FAULTS_ONCE_DIR."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration  # python subprocesses

SCRIPT = """
from miles.common.faults import crash_point
for key in range(3):
    crash_point("demo.point", key)
print("survived")
"""


def run(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=60)


def test_crash_points_fire_only_when_armed_for_their_key_and_once_per_directory(tmp_path: Path) -> None:
    assert run({}).stdout.strip() == "survived"
    assert run({"MILES_FAULTS": "other.point"}).returncode == 0
    armed = run({"MILES_FAULTS": "demo.point=1"})
    assert armed.returncode == 137 and "survived" not in armed.stdout
    assert run({"MILES_FAULTS": "demo.point=7"}).returncode == 0
    once = {"MILES_FAULTS": "demo.point", "MILES_FAULTS_ONCE_DIR": str(tmp_path)}
    assert run(once).returncode == 137
    assert run(once).returncode == 0  # the restarted process runs on
