"""ServiceProcess children die with the process that started them, so killed test runs leave no servers."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration  # python subprocesses

STARTER = """
import sys, time
from pathlib import Path
from miles.common.testing import ServiceProcess
child = ServiceProcess([sys.executable, "-c", "import time; time.sleep(300)"], ready_url=None,
                       log_path=Path(sys.argv[1])).start()
print(child.pid, flush=True)
time.sleep(300)
"""


def test_child_gets_terminated_when_its_starter_is_killed(tmp_path: Path) -> None:
    starter = subprocess.Popen(
        [sys.executable, "-c", STARTER, str(tmp_path / "child.log")], stdout=subprocess.PIPE, text=True
    )
    assert starter.stdout is not None
    child_pid = int(starter.stdout.readline())
    os.kill(child_pid, 0)  # alive while its starter lives
    starter.kill()
    starter.wait()
    for _ in range(400):
        if not is_running(child_pid):
            return
        time.sleep(0.05)
    raise AssertionError(f"child {child_pid} outlived its killed starter")


def is_running(pid: int) -> bool:
    """False once the process is gone or a zombie (this container's init may not reap orphans)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"
