"""`miles up` / `status` / `jobs` / `down` for real: the shared services as processes, then nothing left behind.

One test (the services take a while to import on a busy machine): up starts redis, buffer, sandbox gateway,
router, session server and controller, each ready and recorded with its pid file; a second `up` sees it is
already up; status reports every service ready and the controller answers `jobs`; the keeper restarts services
killed with -9 (Redis among them) on their ports; with the keeper dead too, a second `up` restarts what died on
the same ports and a new keeper; down stops every process (keeper included) and removes the pid files and the
state file. No job is run here (tests/test_e2e_controller.py and the chaos target do that).
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from typer.testing import CliRunner

from miles.cli.launcher import SERVICE_ORDER, Layout, load_state, pid_alive, stop_platform
from miles.cli.main import app
from miles.cli.platform_keeper import KEEPER_PROGRAM
from miles.cli.platform_state import PlatformState, is_ready

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

    healed = _kill_and_wait_for_the_keeper(home, state, ["redis", "buffer", "router"])
    assert {name: healed.services[name].restarts for name in ("redis", "buffer", "router")} == dict.fromkeys(
        ("redis", "buffer", "router"), 1
    )

    os.kill(healed.keeper_pid, signal.SIGKILL)
    os.kill(healed.services["session"].pid, signal.SIGKILL)
    session = healed.services["session"]
    deadline = time.monotonic() + 30.0  # a killed process's /proc entry outlives the signal for a moment
    while (pid_alive(healed.keeper_pid, KEEPER_PROGRAM) or pid_alive(session.pid, session.program)) and (
        time.monotonic() < deadline
    ):
        time.sleep(0.05)
    again = runner.invoke(app, ["up", "--home", str(home)])
    assert again.exit_code == 0, again.output
    assert "restarted on the same ports: session" in " ".join(again.output.split())
    final = load_state(Layout(home))
    assert final is not None and pid_alive(final.keeper_pid, KEEPER_PROGRAM)
    assert {n: r.url for n, r in final.services.items()} == {n: r.url for n, r in state.services.items()}
    assert all(is_ready(record) for record in final.services.values())

    down = runner.invoke(app, ["down", "--home", str(home)])
    assert down.exit_code == 0, down.output
    assert all(not pid_alive(r.pid, r.program) for r in final.services.values())
    assert not pid_alive(final.keeper_pid, KEEPER_PROGRAM)
    assert not list((home / "run").glob("*.pid")) and load_state(Layout(home)) is None


def _kill_and_wait_for_the_keeper(home: Path, state: PlatformState, names: list[str]) -> PlatformState:
    """kill -9 `names`; wait until the keeper has them running and ready again, at the same addresses."""
    assert pid_alive(state.keeper_pid, KEEPER_PROGRAM)
    for name in names:
        os.kill(state.services[name].pid, signal.SIGKILL)
    deadline = time.monotonic() + 120.0
    while time.monotonic() < deadline:
        current = load_state(Layout(home))
        assert current is not None
        records = [current.services[name] for name in names]
        if all(r.pid != state.services[r.name].pid and pid_alive(r.pid, r.program) for r in records) and all(
            is_ready(r) for r in current.services.values()
        ):
            assert {n: r.url for n, r in current.services.items()} == {n: r.url for n, r in state.services.items()}
            return current
        time.sleep(0.2)
    raise AssertionError(f"the keeper did not restart {names}: {load_state(Layout(home))}")
