"""miles.common.spawn: settings become the service's MILES_<SERVICE>_ variables, a spawned process gets the
spawner's environment plus its own, appends to its log in a session of its own, and terminate escalates to
SIGKILL for a process that ignores SIGTERM."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import pytest

from miles.common.spawn import ProcessSpec, console_script, kill, settings_env, spawn, terminate


def test_settings_env_uses_the_service_prefix_and_renders_values_as_the_settings_parse_them() -> None:
    env = settings_env(
        "BUFFER", {"port": 8080, "log_json": False, "state_dir": Path("/tmp/x"), "api_tokens": ["a", "b"]}
    )
    assert env == {
        "MILES_BUFFER_PORT": "8080",
        "MILES_BUFFER_LOG_JSON": "false",
        "MILES_BUFFER_STATE_DIR": "/tmp/x",
        "MILES_BUFFER_API_TOKENS": '["a", "b"]',
    }


def test_settings_env_omits_unset_tokens_only_when_asked() -> None:
    tokens = {"admin_api_key": "k", "api_key": ""}
    assert settings_env("ENGINE", tokens, omit_empty=True) == {"MILES_ENGINE_ADMIN_API_KEY": "k"}
    assert settings_env("ENGINE", tokens)["MILES_ENGINE_API_KEY"] == ""


@pytest.mark.integration
def test_spawned_process_gets_its_env_cwd_log_and_own_session(tmp_path: Path) -> None:
    script = "import os; print(os.environ['MILES_TEST_VALUE'], os.getcwd(), os.getsid(0) == os.getpid())"
    log_path = tmp_path / "logs" / "child.log"
    spec = ProcessSpec(
        (sys.executable, "-c", script), log_path, {"MILES_TEST_VALUE": "v1"}, cwd=tmp_path, log_banner=True
    )
    process = spawn(spec)
    assert process.wait(timeout=30) == 0
    lines = log_path.read_text().splitlines()
    assert lines[1].startswith("--- start ") and sys.executable in lines[1]
    assert lines[2] == f"v1 {tmp_path} True"


@pytest.mark.integration
def test_terminate_kills_a_process_that_ignores_sigterm(tmp_path: Path) -> None:
    script = (
        "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('up', flush=True); time.sleep(60)"
    )
    log_path = tmp_path / "stubborn.log"
    process = spawn(ProcessSpec((sys.executable, "-c", script), log_path))
    deadline = time.monotonic() + 30
    while "up" not in log_path.read_text() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert terminate(process, grace_s=0.5) == -signal.SIGKILL


@pytest.mark.integration
def test_kill_outside_a_session_signals_only_the_process(tmp_path: Path) -> None:
    process = spawn(
        ProcessSpec((sys.executable, "-c", "import time; time.sleep(60)"), tmp_path / "x.log", new_session=False)
    )
    assert os.getpgid(process.pid) == os.getpgid(0)  # in our group: signalling the group would hit this test
    assert kill(process) == -signal.SIGKILL


def test_console_script_looks_beside_the_interpreter_first_and_names_a_missing_one() -> None:
    beside = Path(sys.executable).parent / "python"
    if beside.exists():
        assert console_script("python") == str(beside)
    with pytest.raises(FileNotFoundError, match="make setup"):
        console_script("miles-no-such-script")
