"""Escape attempts against the local (bubblewrap) backend, through a real gateway process over gRPC.

Each test makes one attempt, asserts the specific containment (an error, exit code or limit flag, and that
nothing leaked to the host), then asserts the gateway keeps serving. Limits are small so the suite is quick.
"""

from __future__ import annotations

import signal
import socket
import threading
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import grpc
import pytest

from miles.common.testing import free_port

if TYPE_CHECKING:
    from conftest import Gateway, SandboxClient

pytestmark = [pytest.mark.escape, pytest.mark.integration]

AssertServing = Callable[["Gateway"], None]


def test_escape_dns_lookup_fails(gateway: Gateway, sandbox: str, assert_serving: AssertServing) -> None:
    script = (
        "import socket, sys\n"
        "try:\n"
        "    socket.getaddrinfo('example.com', 443)\n"
        "except socket.gaierror as exc:\n"
        "    print('dns-failed', exc.errno); sys.exit(3)\n"
        "print('resolved')\n"
    )
    outcome = gateway.client.exec(sandbox, argv=["python3", "-c", script])
    assert outcome.result.exit_code == 3, outcome
    assert outcome.text.startswith("dns-failed")
    interfaces = gateway.client.exec(sandbox, argv=["cat", "/proc/net/dev"]).text
    assert [line.split(":")[0].strip() for line in interfaces.splitlines()[2:]] == ["lo"]
    assert_serving(gateway)


@pytest.fixture
def host_tcp_server() -> Iterator[tuple[int, list[tuple[str, int]], threading.Event]]:
    """A TCP server on the host's 127.0.0.1 recording every connection it accepts."""
    accepted: list[tuple[str, int]] = []
    server = socket.create_server(("127.0.0.1", free_port()))
    server.settimeout(0.2)
    stop = threading.Event()
    got_one = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, address = server.accept()
            except TimeoutError:
                continue
            accepted.append(address)
            conn.close()
            got_one.set()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield server.getsockname()[1], accepted, got_one
    stop.set()
    thread.join()
    server.close()


def test_escape_tcp_to_host_loopback_is_refused(
    gateway: Gateway,
    sandbox: str,
    host_tcp_server: tuple[int, list[tuple[str, int]], threading.Event],
    assert_serving: AssertServing,
) -> None:
    port, accepted, got_one = host_tcp_server
    gateway_grpc_port = int(gateway.grpc_target.rsplit(":", 1)[1])
    script = (
        "import socket, sys\n"
        "codes = []\n"
        "for port in map(int, sys.argv[1:]):\n"
        "    try:\n"
        "        socket.create_connection(('127.0.0.1', port), timeout=2).close(); codes.append('connected')\n"
        "    except OSError as exc:\n"
        "        codes.append(exc.errno)\n"
        "print(codes); sys.exit(0 if 'connected' in codes else 3)\n"
    )
    outcome = gateway.client.exec(sandbox, argv=["python3", "-c", script, str(port), str(gateway_grpc_port)])
    assert outcome.result.exit_code == 3, outcome
    assert outcome.text.strip() == "[111, 111]"  # ECONNREFUSED: the sandbox's loopback is its own
    with socket.create_connection(("127.0.0.1", port), timeout=2) as probe:
        probe_port = probe.getsockname()[1]  # the server itself is reachable from the host ...
    assert got_one.wait(30)
    assert accepted == [("127.0.0.1", probe_port)]  # ... and saw only that connection, none from the sandbox
    assert_serving(gateway)


def test_escape_reading_root_home_fails(gateway: Gateway, sandbox: str, assert_serving: AssertServing) -> None:
    assert Path("/root").is_dir()
    outcome = gateway.client.exec(sandbox, shell="ls -la /root; cat /root/.bashrc /root/.profile")
    assert outcome.result.exit_code != 0
    assert outcome.stdout == b""
    assert b"No such file or directory" in outcome.stderr
    assert_serving(gateway)


def test_escape_reading_etc_shadow_fails(gateway: Gateway, sandbox: str, assert_serving: AssertServing) -> None:
    assert Path("/etc/shadow").read_text()  # the host file exists and has content
    outcome = gateway.client.exec(sandbox, argv=["cat", "/etc/shadow", "/etc/gshadow"])
    assert outcome.result.exit_code == 1
    assert outcome.stdout == b""
    assert outcome.stderr.count(b"Permission denied") == 2
    assert_serving(gateway)


def test_escape_reading_another_sandboxs_files_fails(
    gateway: Gateway, client: SandboxClient, sandbox: str, assert_serving: AssertServing
) -> None:
    token = uuid.uuid4().hex
    victim = client.create(job_id="victim").sandbox_id
    try:
        client.write(victim, "secret.txt", token.encode())
        assert client.read(victim, "secret.txt").data == token.encode()
        victim_host_path = gateway.state_dir / victim / "work" / "secret.txt"
        assert victim_host_path.read_text() == token  # where it lives on the host
        outcome = client.exec(
            sandbox,
            shell=(
                f"cat {victim_host_path}; ls {gateway.state_dir}; ls -a /workspace; "
                # everything the sandbox can see except the host's read-only /usr (slow to scan, and not writable)
                f"grep -rs {token} / --exclude-dir=usr --exclude-dir=proc; cat /proc/*/root/workspace/secret.txt"
            ),
        )
        assert token.encode() not in outcome.stdout + outcome.stderr
        assert outcome.result.exit_code != 0
        with pytest.raises(grpc.RpcError) as error:
            client.read(sandbox, f"../{victim}/work/secret.txt")
        assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        with pytest.raises(grpc.RpcError) as error:
            client.read(sandbox, str(victim_host_path))
        assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    finally:
        client.destroy(victim)
    assert_serving(gateway)


def test_escape_symlinks_are_not_followed_by_the_file_api(
    gateway: Gateway, client: SandboxClient, sandbox: str, assert_serving: AssertServing
) -> None:
    outcome = client.exec(sandbox, shell="ln -s /etc/shadow shadow && mkdir d && ln -s / d/root && ln -s / up")
    assert outcome.result.exit_code == 0
    for path in ("shadow", "d/root/etc/shadow", "up/etc/passwd"):
        with pytest.raises(grpc.RpcError) as error:
            client.read(sandbox, path)
        assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "symlink" in (error.value.details() or "")
    with pytest.raises(grpc.RpcError) as error:
        client.write(sandbox, "up/tmp/evil", b"x")
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert not Path("/tmp/evil").exists()
    assert Path("/etc/shadow").stat().st_size > 0  # untouched
    assert_serving(gateway)


def test_escape_host_process_list_is_hidden(gateway: Gateway, sandbox: str, assert_serving: AssertServing) -> None:
    outcome = gateway.client.exec(sandbox, argv=["ps", "-eo", "pid,user,args"])
    assert outcome.result.exit_code == 0
    listing = outcome.text
    assert "miles-sandbox-gateway" not in listing and "pytest" not in listing
    assert len(listing.strip().splitlines()) <= 5  # header, bwrap init, keeper sleep, this ps
    kill = gateway.client.exec(sandbox, argv=["kill", "-9", str(gateway.pid)])
    assert kill.result.exit_code != 0
    assert_serving(gateway)


def test_escape_privileges_are_dropped(gateway: Gateway, sandbox: str, assert_serving: AssertServing) -> None:
    status_lines = "grep -E '^(Cap(Inh|Prm|Eff|Bnd|Amb)|NoNewPrivs)' /proc/self/status"
    outcome = gateway.client.exec(sandbox, shell=f"id -u; id -G; {status_lines}")
    lines = outcome.text.split("\n")
    uid = int(lines[0])
    assert uid >= 200000  # a uid of its own from the sandbox range, not root
    assert lines[1] == str(uid)  # no supplementary groups
    status = dict(line.split(":\t") for line in lines[2:] if line)
    assert status == {
        "CapInh": "0000000000000000",
        "CapPrm": "0000000000000000",
        "CapEff": "0000000000000000",
        "CapBnd": "0000000000000000",
        "CapAmb": "0000000000000000",
        "NoNewPrivs": "1",
    }
    assert_serving(gateway)


def test_escape_gateway_environment_does_not_leak(
    gateway: Gateway, sandbox: str, assert_serving: AssertServing
) -> None:
    outcome = gateway.client.exec(sandbox, shell="env; cat /proc/*/environ 2>/dev/null | tr '\\0' '\\n'")
    assert b"gateway-secret-7f3a" not in outcome.stdout
    assert b"MILES_SANDBOX" not in outcome.stdout
    assert_serving(gateway)


def test_escape_writing_outside_the_work_dir_fails(
    gateway: Gateway, sandbox: str, assert_serving: AssertServing
) -> None:
    marker = f"miles-escape-{uuid.uuid4().hex}"
    targets = [f"/usr/{marker}", f"/etc/{marker}", f"/{marker}", f"/bin/{marker}", f"/dev/{marker}"]
    targets.append("/proc/sys/kernel/hostname")
    script = "; ".join(f"(echo x > {target}) 2>/dev/null && echo WROTE {target}" for target in targets)
    script += f"; echo x > /tmp/{marker} && echo private-tmp-ok; hostname evil"
    outcome = gateway.client.exec(sandbox, shell=script)
    assert "WROTE" not in outcome.text
    assert "private-tmp-ok" in outcome.text  # /tmp is writable, but private to the sandbox:
    assert not Path(f"/tmp/{marker}").exists()
    assert outcome.result.exit_code != 0  # hostname evil: not permitted
    for target in targets[:5]:
        assert not Path(target).exists()
    assert socket.gethostname() != "evil"
    assert_serving(gateway)


def test_escape_fork_bomb_is_contained(
    gateway: Gateway, client: SandboxClient, uid_processes_end: Callable[[int], bool], assert_serving: AssertServing
) -> None:
    sandbox = client.create(job_id="bomb", limits={"max_processes": 32}).sandbox_id
    try:
        uid = int(client.exec(sandbox, argv=["id", "-u"]).text)
        forker = (
            "import os, time\n"
            "children = 0\n"
            "try:\n"
            "    while True:\n"
            "        if os.fork() == 0:\n"
            "            time.sleep(60); os._exit(0)\n"
            "        children += 1\n"
            "except OSError as exc:\n"
            "    print('refused-after', children, exc.errno)\n"
        )
        outcome = client.exec(sandbox, argv=["python3", "-c", forker], timeout_s=20)
        words = outcome.text.split()
        assert words[0] == "refused-after" and int(words[1]) < 32 and words[2] == "11"  # EAGAIN
        assert "processes" in outcome.limits_hit
        shell_bomb = client.exec(sandbox, shell="bomb() { bomb | bomb & }; bomb; sleep 1", timeout_s=20)
        assert "processes" in shell_bomb.limits_hit
        assert uid_processes_end(uid)  # the bombs die with their execs
        assert client.exec(sandbox, argv=["echo", "ok"]).stdout == b"ok\n"  # the sandbox itself still works
    finally:
        client.destroy(sandbox)
    assert_serving(gateway)


def test_escape_memory_bomb_is_killed(gateway: Gateway, client: SandboxClient, assert_serving: AssertServing) -> None:
    sandbox = client.create(job_id="bomb", limits={"memory_bytes": 128 << 20}).sandbox_id
    try:
        bomb = "chunks = []\nwhile True:\n    chunks.append(bytearray(16 << 20))\n"
        outcome = client.exec(sandbox, argv=["python3", "-c", bomb], timeout_s=30)
        assert "memory" in outcome.limits_hit
        # With a memory cgroup the OOM killer ends it (SIGKILL); without one RLIMIT_AS makes it fail (MemoryError).
        assert outcome.result.signal == signal.SIGKILL or b"MemoryError" in outcome.stderr
        assert client.exec(sandbox, argv=["echo", "ok"]).stdout == b"ok\n"
    finally:
        client.destroy(sandbox)
    assert_serving(gateway)


def test_escape_cpu_spin_is_killed_at_timeout(gateway: Gateway, sandbox: str, assert_serving: AssertServing) -> None:
    outcome = gateway.client.exec(sandbox, shell="while :; do :; done", timeout_s=1)
    assert outcome.limits_hit == {"timeout"}
    assert outcome.result.signal == signal.SIGKILL and outcome.result.exit_code == -1
    assert_serving(gateway)


def test_escape_cpu_time_limit_stops_a_spin(
    gateway: Gateway, client: SandboxClient, assert_serving: AssertServing
) -> None:
    sandbox = client.create(job_id="cpu", limits={"cpu_s": 1}).sandbox_id
    try:
        outcome = client.exec(sandbox, shell="exec sh -c 'while :; do :; done'", timeout_s=60)
        assert "cpu" in outcome.limits_hit and "timeout" not in outcome.limits_hit
        assert outcome.result.signal in (signal.SIGXCPU, signal.SIGKILL)
        assert outcome.result.cpu_s >= 0.9
    finally:
        client.destroy(sandbox)
    assert_serving(gateway)


def test_escape_output_flood_is_capped(
    gateway: Gateway, client: SandboxClient, rss_bytes: Callable[[int], int], assert_serving: AssertServing
) -> None:
    sandbox = client.create(job_id="flood", limits={"max_output_bytes": 64 * 1024}).sandbox_id
    try:
        rss_before = rss_bytes(gateway.pid)
        for stream_redirect in ("", " 1>&2"):
            outcome = client.exec(sandbox, shell=f"cat /dev/zero{stream_redirect}", timeout_s=30)
            assert outcome.limits_hit == {"output"}
            assert outcome.result.signal == signal.SIGKILL
            assert len(outcome.stdout) + len(outcome.stderr) == 64 * 1024
            assert outcome.result.stdout_bytes + outcome.result.stderr_bytes == 64 * 1024
        assert rss_bytes(gateway.pid) - rss_before < 64 << 20
    finally:
        client.destroy(sandbox)
    assert_serving(gateway)


def test_escape_background_processes_die_with_destroy(
    gateway: Gateway, client: SandboxClient, uid_processes: Callable[[int], list[int]], assert_serving: AssertServing
) -> None:
    sandbox = client.create(job_id="orphans").sandbox_id
    outcome = client.exec(
        sandbox,
        shell=(
            "setsid sleep 300 </dev/null >/dev/null 2>&1 & "
            "(setsid sh -c 'while :; do sleep 1; done' </dev/null >/dev/null 2>&1 &); "
            "nohup setsid python3 -c 'import time; time.sleep(300)' </dev/null >/dev/null 2>&1 & "
            "sleep 0.3; id -u"
        ),
    )
    uid = int(outcome.text)
    survivors = uid_processes(uid)
    assert len(survivors) >= 3  # the detached processes outlived their exec (by design) ...
    assert client.exec(sandbox, shell="ps -e | grep -c sleep").text.strip() != "0"
    assert client.destroy(sandbox)
    assert uid_processes(uid) == []  # ... and none outlives Destroy
    assert not (gateway.state_dir / sandbox).exists()
    assert client.destroy(sandbox) is False  # idempotent
    assert_serving(gateway)
