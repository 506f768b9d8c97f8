"""`miles up` / `status` / `jobs` / `down` for real: the shared services as processes, then nothing left behind.

One test (the services take a while to import on a busy machine): up starts redis, buffer, sandbox gateway,
router, session server and controller, each ready and recorded with its pid file; a second `up` sees it is
already up; status reports every service ready and the controller answers `jobs`; down stops every process and
removes the pid files and the state file. No job is run here (tests/test_e2e_controller.py does that).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import pytest
from typer.testing import CliRunner

from miles.controller.cli import app
from miles.controller.cli_platform import SERVICE_ORDER, Layout, load_state, pid_alive, stop_platform

pytestmark = pytest.mark.integration


@pytest.fixture
def home(tmp_path: Path) -> Iterator[Path]:
    yield tmp_path / "miles-home"
    with contextlib.suppress(Exception):  # a failed test must not leave services behind
        stop_platform(Layout(tmp_path / "miles-home"), grace_s=5.0)


def test_up_status_down_starts_every_shared_service_and_leaves_nothing_running(home: Path) -> None:
    runner = CliRunner()
    up = runner.invoke(app, ["up", "--home", str(home)])
    assert up.exit_code == 0, up.output
    state = load_state(Layout(home))
    assert state is not None
    assert set(state.services) == set(SERVICE_ORDER)
    for name, record in state.services.items():
        assert pid_alive(record.pid, record.program), name
        assert (home / "run" / f"{name}.pid").read_text().strip() == str(record.pid)
        assert Path(record.log_path).is_file()

    again = runner.invoke(app, ["up", "--home", str(home)])
    assert again.exit_code == 0 and "already up" in again.output

    status = runner.invoke(app, ["status", "--home", str(home)])
    assert status.exit_code == 0, status.output
    assert status.output.count("ready") >= len(SERVICE_ORDER) and "stopped" not in status.output
    assert "no active jobs" in status.output
    jobs = runner.invoke(app, ["jobs", "--home", str(home), "--json"])
    assert jobs.exit_code == 0 and jobs.output.strip() == "[]"

    down = runner.invoke(app, ["down", "--home", str(home)])
    assert down.exit_code == 0, down.output
    assert all(not pid_alive(r.pid, r.program) for r in state.services.values())
    assert not list((home / "run").glob("*.pid")) and load_state(Layout(home)) is None
