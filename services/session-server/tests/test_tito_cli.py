"""`miles-tito` runs as the installed console script."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration  # runs the miles-tito console script


def _miles_tito(*args: str) -> subprocess.CompletedProcess[str]:
    script = shutil.which("miles-tito", path=str(Path(sys.executable).parent))
    assert script is not None, "miles-tito is not installed: pip install --no-deps -e services/session-server"
    return subprocess.run([script, *args], capture_output=True, text=True, timeout=300, check=False)


def test_verify_one_family_prints_rows_and_the_summary_line() -> None:
    done = _miles_tito("verify", "--family", "kimi-k2", "--roles", "tool,user")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.strip().splitlines()
    assert lines[0].split()[:3] == ["family", "roles", "level"]
    assert lines[1].split()[:3] == ["kimi-k2", "tool,user", "text"]
    assert lines[-1] == "critical_mismatches=0 combos=1"


def test_verify_json_report() -> None:
    done = _miles_tito("verify", "--family", "llama-3", "--roles", "tool", "--json")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["critical_mismatches"] == 0 and report["num_combos"] == 1
    (combo,) = report["combos"]
    assert combo["family"] == "llama-3" and combo["level"] == "token" and combo["turns"] > 0
    assert combo["skipped"] >= 1  # parallel tool calls: the Llama template allows one call per turn


def test_verify_without_a_selection_or_with_an_unsupported_role_set_runs_nothing() -> None:
    assert _miles_tito("verify").returncode == 2
    done = _miles_tito("verify", "--family", "deepseek-v3", "--roles", "tool,user,system")
    assert done.returncode == 2
    assert "deepseek-v3: no {tool,user,system} combo" in done.stderr


def test_families_lists_role_sets() -> None:
    done = _miles_tito("families")
    assert done.returncode == 0
    rows = {line.split()[0]: line for line in done.stdout.splitlines()}
    assert "{tool} {tool,user} {tool,user,system}" in rows["glm-4.7"]
    assert "{tool,user,system}" not in rows["minimax-m2"]
