"""The local backend's unprivileged mode (how the gateway runs in its non-root container image): a gateway
started as an ordinary uid runs sandboxes inside a user namespace, still without network, host files or the
host's processes."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from miles.common.testing import ServiceProcess, free_port
from miles.common.testing.smoke import console_script

pytestmark = [pytest.mark.integration, pytest.mark.escape]

UNPRIVILEGED_UID = 10001


@pytest.fixture
def unprivileged_gateway() -> Iterator[tuple[str, Path]]:
    if os.geteuid() != 0:
        pytest.skip("needs root to start the gateway as another, unprivileged uid")
    home = Path(tempfile.mkdtemp(prefix="miles-userns-"))
    os.chown(home, UNPRIVILEGED_UID, UNPRIVILEGED_UID)
    port, http_port = free_port(), free_port()
    env = {
        "HOME": str(home),
        "TMPDIR": str(home),
        "MILES_SANDBOX_PORT": str(port),
        "MILES_SANDBOX_METRICS_PORT": str(http_port),
        "MILES_SANDBOX_STATE_DIR": str(home / "state"),
        "MILES_SANDBOX_WARM_POOL_SIZE": "0",
    }
    argv = ["setpriv", f"--reuid={UNPRIVILEGED_UID}", f"--regid={UNPRIVILEGED_UID}", "--clear-groups"]
    process = ServiceProcess(
        [*argv, console_script("miles-sandbox-gateway")],
        ready_url=f"http://127.0.0.1:{http_port}/readyz",
        env=env,
        log_path=home / "gateway.log",
    )
    try:
        process.start()
        yield f"http://127.0.0.1:{http_port}", home
    finally:
        process.stop()
        shutil.rmtree(home, ignore_errors=True)


def test_unprivileged_gateway_isolates_sandboxes_in_a_user_namespace(
    unprivileged_gateway: tuple[str, Path],
) -> None:
    import httpx

    base, home = unprivileged_gateway
    probe = (
        "id -u; grep NoNewPrivs /proc/self/status; cat /proc/self/uid_map; "
        "ps -eo comm= | sort -u | tr '\\n' ' '; echo; "
        "cat /etc/shadow 2>&1; ls /root 2>&1; "
        "python3 -c \"import socket; socket.create_connection(('127.0.0.1', 1), 1)\" 2>&1 | tail -1; "
        f"ls {home} 2>&1"
    )
    with httpx.Client(base_url=base, timeout=60) as http:
        created = http.post("/v1/sandboxes", json={"job_id": "userns"})
        assert created.status_code == 201, created.text
        sandbox_id = created.json()["sandbox_id"]
        outcome = http.post(f"/v1/sandboxes/{sandbox_id}/exec", json={"shell": probe, "stream": False}).json()
        lines = outcome["stdout"].splitlines()
        assert lines[0] == str(UNPRIVILEGED_UID)  # the gateway's own uid, no more
        assert lines[1].split() == ["NoNewPrivs:", "1"]
        assert lines[2].split() == [str(UNPRIVILEGED_UID), str(UNPRIVILEGED_UID), "1"]  # a user namespace
        assert set(lines[3].split()) <= {"bwrap", "sleep", "sh", "ps", "sort", "tr"}  # its own processes only
        assert "Permission denied" in lines[4] and "No such file" in lines[5]
        assert "Connection refused" in lines[6]
        assert "No such file" in lines[7]  # the gateway's files are not mounted
        assert http.delete(f"/v1/sandboxes/{sandbox_id}").json() == {"destroyed": True}
