"""The local backend's unprivileged mode (how the gateway runs in its non-root container image): a gateway
started as an ordinary uid runs sandboxes inside a user namespace, still without network, host files or the
host's processes, and with no way to create further user namespaces: the seccomp filter refuses them, and
where bwrap has --disable-userns (0.8.0 and later) the sandbox's user namespace is also nested in one whose
user.max_user_namespaces is 1. Which of the two applies is read from the installed bwrap, never assumed; a
wrapper hiding --disable-userns checks the filter-only case and its start-up warning."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from miles.common.testing import ServiceProcess, free_port
from miles.common.testing.smoke import console_script
from miles.sandbox.local.bwrap import find_host_tools

pytestmark = [pytest.mark.integration, pytest.mark.escape]

UNPRIVILEGED_UID = 10001
NS_GET_PARENT = 0xB702  # _IO(0xb7, 0x2)

# Run on the host as root: the user-namespace limit of the parent of a process's user namespace ("host" when
# that parent is the host's own user namespace, i.e. nothing was nested).
PARENT_USERNS_LIMIT = rf"""
import ctypes, fcntl, os, sys
own = os.open(f"/proc/{{sys.argv[1]}}/ns/user", os.O_RDONLY)
parent = fcntl.ioctl(own, {NS_GET_PARENT})
if os.fstat(parent).st_ino == os.stat("/proc/self/ns/user").st_ino:
    print("host")
    sys.exit()
if ctypes.CDLL(None, use_errno=True).setns(parent, 0x10000000) != 0:  # CLONE_NEWUSER
    raise OSError(ctypes.get_errno(), "setns")
print(open("/proc/sys/user/max_user_namespaces").read().strip())
"""


@dataclass
class UnprivilegedGateway:
    http: httpx.Client
    home: Path
    process: ServiceProcess


@pytest.fixture
def start_unprivileged_gateway() -> Iterator[Callable[..., UnprivilegedGateway]]:
    """start(**env): a gateway running as UNPRIVILEGED_UID (extra MILES_SANDBOX_* variables in env)."""
    if os.geteuid() != 0:
        pytest.skip("needs root to start the gateway as another, unprivileged uid")
    started: list[UnprivilegedGateway] = []

    def start(**extra_env: str) -> UnprivilegedGateway:
        home = Path(tempfile.mkdtemp(prefix="miles-userns-"))
        os.chown(home, UNPRIVILEGED_UID, UNPRIVILEGED_UID)
        http_port = free_port()
        env = {
            "HOME": str(home),
            "TMPDIR": str(home),
            "MILES_SANDBOX_PORT": str(free_port()),
            "MILES_SANDBOX_METRICS_PORT": str(http_port),
            "MILES_SANDBOX_STATE_DIR": str(home / "state"),
            "MILES_SANDBOX_WARM_POOL_SIZE": "0",
            **{f"MILES_SANDBOX_{key.upper()}": value for key, value in extra_env.items()},
        }
        argv = ["setpriv", f"--reuid={UNPRIVILEGED_UID}", f"--regid={UNPRIVILEGED_UID}", "--clear-groups"]
        process = ServiceProcess(
            [*argv, console_script("miles-sandbox-gateway")],
            ready_url=f"http://127.0.0.1:{http_port}/readyz",
            env=env,
            log_path=home / "gateway.log",
        )
        gateway = UnprivilegedGateway(httpx.Client(base_url=f"http://127.0.0.1:{http_port}", timeout=60), home, process)
        started.append(gateway)
        process.start()
        return gateway

    yield start
    for gateway in started:
        gateway.http.close()
        gateway.process.stop()
        shutil.rmtree(gateway.home, ignore_errors=True)


def _run(gateway: UnprivilegedGateway, shell: str) -> dict[str, object]:
    created = gateway.http.post("/v1/sandboxes", json={"job_id": "userns"})
    assert created.status_code == 201, created.text
    sandbox_id = created.json()["sandbox_id"]
    outcome: dict[str, object] = gateway.http.post(
        f"/v1/sandboxes/{sandbox_id}/exec", json={"shell": shell, "stream": False}
    ).json()
    outcome["sandbox_id"] = sandbox_id
    return outcome


def _descendants_named(pid: int, name: str) -> list[int]:
    """Host processes below pid whose comm is name (an independent /proc scan)."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parents[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    below, frontier = [], [pid]
    while frontier:
        children = [child for child, parent in parents.items() if parent in frontier]
        below += children
        frontier = children
    return [found for found in below if Path(f"/proc/{found}/comm").read_text().strip() == name]


def _parent_userns_limit(gateway: UnprivilegedGateway) -> str:
    # One sandbox: one keeper. Polled: a CI run's single /proc scan found none right after an exec (the scan is
    # not atomic: a process that forks or exits meanwhile can break the parent chain for that one pass).
    deadline = time.monotonic() + 10.0
    while len(found := _descendants_named(gateway.process.pid, "sleep")) != 1 and time.monotonic() < deadline:
        time.sleep(0.2)
    (keeper_sleep,) = found
    finished = subprocess.run(
        [sys.executable, "-c", PARENT_USERNS_LIMIT, str(keeper_sleep)], capture_output=True, text=True, check=True
    )
    return finished.stdout.strip()


NESTED_USERNS_PROBE = "grep Seccomp: /proc/self/status; unshare -U true; unshare -Ur id; echo done"


def test_unprivileged_gateway_isolates_sandboxes_in_a_user_namespace(
    start_unprivileged_gateway: Callable[..., UnprivilegedGateway],
) -> None:
    gateway = start_unprivileged_gateway()
    probe = (
        "id -u; grep NoNewPrivs /proc/self/status; cat /proc/self/uid_map; "
        "ps -eo comm= | sort -u | tr '\\n' ' '; echo; "
        "cat /etc/shadow 2>&1; ls /root 2>&1; "
        "python3 -c \"import socket; socket.create_connection(('127.0.0.1', 1), 1)\" 2>&1 | tail -1; "
        f"ls {gateway.home} 2>&1"
    )
    outcome = _run(gateway, probe)
    lines = str(outcome["stdout"]).splitlines()
    assert lines[0] == str(UNPRIVILEGED_UID)  # the gateway's own uid, no more
    assert lines[1].split() == ["NoNewPrivs:", "1"]
    assert lines[2].split() == [str(UNPRIVILEGED_UID), str(UNPRIVILEGED_UID), "1"]  # a user namespace
    assert set(lines[3].split()) <= {"bwrap", "sleep", "sh", "ps", "sort", "tr"}  # its own processes only
    assert "Permission denied" in lines[4] and "No such file" in lines[5]
    assert "Connection refused" in lines[6]
    assert "No such file" in lines[7]  # the gateway's files are not mounted
    assert gateway.http.delete(f"/v1/sandboxes/{outcome['sandbox_id']}").json() == {"destroyed": True}


def test_unprivileged_sandboxes_cannot_create_user_namespaces(
    start_unprivileged_gateway: Callable[..., UnprivilegedGateway],
) -> None:
    bwrap = find_host_tools("bwrap")
    gateway = start_unprivileged_gateway()
    outcome = _run(gateway, NESTED_USERNS_PROBE)
    assert str(outcome["stdout"]).split() == ["Seccomp:", "2", "done"]
    assert str(outcome["stderr"]).count("unshare failed: Operation not permitted") == 2
    # The second barrier is there exactly when the installed bwrap offers it.
    assert _parent_userns_limit(gateway) == ("1" if bwrap.bwrap_disables_userns else "host")
    warned = "bwrap has no --disable-userns" in gateway.process.log_tail(100_000)
    assert warned == (not bwrap.bwrap_disables_userns)


def test_a_bwrap_without_disable_userns_leaves_the_filter_alone_and_warns(
    start_unprivileged_gateway: Callable[..., UnprivilegedGateway],
) -> None:
    real_bwrap = shutil.which("bwrap")
    assert real_bwrap is not None, "the local backend tests need bubblewrap (apt-get install -y bubblewrap)"
    # A wrapper the unprivileged uid can run, whose --help hides --disable-userns (like bubblewrap before 0.8.0).
    wrapper_dir = Path(tempfile.mkdtemp(prefix="miles-old-bwrap-"))
    wrapper_dir.chmod(0o755)
    wrapper = wrapper_dir / "bwrap"
    wrapper.write_text(
        "#!/bin/sh\n"
        f'if [ "$1" = --help ]; then {real_bwrap} --help | grep -v -- --disable-userns; exit 0; fi\n'
        f'exec {real_bwrap} "$@"\n'
    )
    wrapper.chmod(stat.S_IRWXU | stat.S_IRGRP | stat.S_IXGRP | stat.S_IROTH | stat.S_IXOTH)
    try:
        assert not find_host_tools(str(wrapper)).bwrap_disables_userns
        gateway = start_unprivileged_gateway(bwrap_path=str(wrapper))
        assert "bwrap has no --disable-userns" in gateway.process.log_tail(100_000)
        outcome = _run(gateway, NESTED_USERNS_PROBE)
        assert str(outcome["stdout"]).split() == ["Seccomp:", "2", "done"]
        assert str(outcome["stderr"]).count("unshare failed: Operation not permitted") == 2  # the filter alone
        assert _parent_userns_limit(gateway) == "host"  # nothing nested
    finally:
        shutil.rmtree(wrapper_dir, ignore_errors=True)
