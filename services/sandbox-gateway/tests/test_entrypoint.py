"""miles-sandbox-gateway starts as a real process and serves the probes every service must serve; without
bubblewrap it refuses to start, saying how to install it (it never runs commands unsandboxed)."""

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
def test_missing_bubblewrap_stops_start_up_with_the_install_command(tmp_path: Path) -> None:
    env = {
        "PATH": "/usr/bin:/bin",
        "MILES_SANDBOX_BWRAP_PATH": str(tmp_path / "no-such-bwrap"),
        "MILES_SANDBOX_PORT": str(free_port()),
        "MILES_SANDBOX_METRICS_PORT": str(free_port()),
    }
    finished = subprocess.run(
        [console_script("miles-sandbox-gateway")], env=env, capture_output=True, text=True, timeout=120
    )
    assert finished.returncode != 0
    assert "apt-get install -y bubblewrap" in finished.stderr
    assert "never runs commands unsandboxed" in finished.stderr
