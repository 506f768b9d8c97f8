"""miles-sandbox-gateway starts as a real process and serves the probes every service must serve; without
bubblewrap, or with one too old for a seccomp filter, it refuses to start, saying how to install it (it never
runs commands unsandboxed)."""

import subprocess
from pathlib import Path

import pytest

from miles.common.testing import free_port
from miles.common.testing.smoke import check_service_entrypoint, console_script


@pytest.mark.integration
def test_sandbox_entrypoint_serves_probes(tmp_path: Path) -> None:
    metrics = check_service_entrypoint("miles-sandbox-gateway", "MILES_SANDBOX_", tmp_path, grpc_service=True)
    assert "# TYPE miles_sandbox_" in metrics


@pytest.mark.integration
def _start_with_bwrap(bwrap_path: Path) -> subprocess.CompletedProcess[str]:
    env = {
        "PATH": "/usr/bin:/bin",
        "MILES_SANDBOX_BWRAP_PATH": str(bwrap_path),
        "MILES_SANDBOX_PORT": str(free_port()),
        "MILES_SANDBOX_METRICS_PORT": str(free_port()),
    }
    argv = [console_script("miles-sandbox-gateway")]
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.integration
def test_missing_bubblewrap_stops_start_up_with_the_install_command(tmp_path: Path) -> None:
    finished = _start_with_bwrap(tmp_path / "no-such-bwrap")
    assert finished.returncode != 0
    assert "apt-get install -y bubblewrap" in finished.stderr
    assert "never runs commands unsandboxed" in finished.stderr


@pytest.mark.integration
def test_a_bubblewrap_without_seccomp_stops_start_up(tmp_path: Path) -> None:
    old_bwrap = tmp_path / "bwrap"
    old_bwrap.write_text("#!/bin/sh\necho 'usage: bwrap [OPTIONS...] [--] COMMAND [ARGS...]'\n")
    old_bwrap.chmod(0o700)
    finished = _start_with_bwrap(old_bwrap)
    assert finished.returncode != 0
    assert "has no --seccomp option" in finished.stderr and "apt-get install -y bubblewrap" in finished.stderr
