"""Shared helpers of the sandbox-gateway tests: a real gateway process, a small gRPC client, /proc scans.

The gateway runs as a real `miles-sandbox-gateway` subprocess with the real local (bubblewrap) backend; tests
talk to it over gRPC and HTTP exactly like agents do. Nothing here is faked.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from miles.common.testing import ServiceProcess, free_port
from miles.common.testing.smoke import console_script
from miles.proto.sandbox.v1 import sandbox_pb2, sandbox_pb2_grpc

LIMIT_NAMES = {value: name.removeprefix("LIMIT_KIND_").lower() for name, value in sandbox_pb2.LimitKind.items()}


@dataclass
class ExecOutcome:
    stdout: bytes
    stderr: bytes
    result: sandbox_pb2.ExecResult
    chunks: list[sandbox_pb2.OutputChunk] = field(default_factory=list)

    @property
    def limits_hit(self) -> set[str]:
        return {LIMIT_NAMES[kind] for kind in self.result.limits_hit}

    @property
    def text(self) -> str:
        return self.stdout.decode(errors="replace")


class SandboxClient:
    """A blocking gRPC client for tests."""

    def __init__(self, target: str) -> None:
        self.channel = grpc.insecure_channel(
            target,
            options=[("grpc.max_receive_message_length", 256 << 20), ("grpc.max_send_message_length", 256 << 20)],
        )
        self.stub = sandbox_pb2_grpc.SandboxServiceStub(self.channel)
        self.health = health_pb2_grpc.HealthStub(self.channel)

    def create(self, **kwargs: object) -> sandbox_pb2.CreateResponse:
        limits = kwargs.pop("limits", None)
        request = sandbox_pb2.CreateRequest(**kwargs)  # type: ignore[arg-type]
        if limits is not None:
            request.limits.CopyFrom(sandbox_pb2.Limits(**limits))  # type: ignore[arg-type]
        return self.stub.Create(request, timeout=30)

    def exec(
        self,
        sandbox_id: str,
        *,
        argv: list[str] | None = None,
        shell: str | None = None,
        timeout_s: float = 30.0,
        **kwargs: object,
    ) -> ExecOutcome:
        request = sandbox_pb2.ExecRequest(sandbox_id=sandbox_id, timeout_s=timeout_s, **kwargs)  # type: ignore[arg-type]
        if argv is not None:
            request.argv.args.extend(argv)
        if shell is not None:
            request.shell = shell
        stdout, stderr, chunks = [], [], []
        result = None
        for event in self.stub.Exec(request, timeout=timeout_s + 60):
            if event.HasField("output"):
                chunks.append(event.output)
                is_stdout = event.output.stream == sandbox_pb2.OUTPUT_STREAM_STDOUT
                (stdout if is_stdout else stderr).append(event.output.data)
            else:
                assert result is None, "exactly one result per exec"
                result = event.result
        assert result is not None, "an exec must end with a result"
        return ExecOutcome(b"".join(stdout), b"".join(stderr), result, chunks)

    def write(self, sandbox_id: str, path: str, data: bytes, mode: int = 0) -> int:
        request = sandbox_pb2.WriteFileRequest(sandbox_id=sandbox_id, path=path, data=data, mode=mode)
        return self.stub.WriteFile(request, timeout=30).bytes_written

    def read(self, sandbox_id: str, path: str, max_bytes: int = 0) -> sandbox_pb2.ReadFileResponse:
        request = sandbox_pb2.ReadFileRequest(sandbox_id=sandbox_id, path=path, max_bytes=max_bytes)
        return self.stub.ReadFile(request, timeout=30)

    def destroy(self, sandbox_id: str) -> bool:
        return self.stub.Destroy(sandbox_pb2.DestroyRequest(sandbox_id=sandbox_id), timeout=30).destroyed

    def list(self, job_id: str = "") -> list[sandbox_pb2.SandboxInfo]:
        return list(self.stub.List(sandbox_pb2.ListRequest(job_id=job_id), timeout=30).sandboxes)

    def close(self) -> None:
        self.channel.close()


@dataclass
class Gateway:
    """A running miles-sandbox-gateway process."""

    process: ServiceProcess
    grpc_target: str
    http_base: str
    state_dir: Path
    client: SandboxClient

    @property
    def pid(self) -> int:
        return self.process.pid


def start_gateway(tmp_dir: Path, **settings: str) -> Gateway:
    """Start the gateway with MILES_SANDBOX_<KEY>=value for each setting (ports and state dir are chosen here)."""
    port, http_port = free_port(), free_port()
    state_dir = tmp_dir / "state"
    env = {
        "MILES_SANDBOX_PORT": str(port),
        "MILES_SANDBOX_METRICS_PORT": str(http_port),
        "MILES_SANDBOX_STATE_DIR": str(state_dir),
        "MILES_SANDBOX_REAPER_INTERVAL_S": "0.2",
        **{f"MILES_SANDBOX_{key.upper()}": value for key, value in settings.items()},
    }
    http_base = f"http://127.0.0.1:{http_port}"
    process = ServiceProcess(
        [console_script("miles-sandbox-gateway")],
        ready_url=f"{http_base}/readyz",
        env=env,
        log_path=tmp_dir / "gateway.log",
    ).start()
    target = f"127.0.0.1:{port}"
    return Gateway(process, target, http_base, state_dir, SandboxClient(target))


def stop_gateway(gateway: Gateway) -> None:
    gateway.client.close()
    gateway.process.stop()


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    """One gateway process per test module (warm pool of 2, small default limits for quick escape tests)."""
    running = start_gateway(
        tmp_path_factory.mktemp("gateway"),
        WARM_POOL_SIZE="2",
        TEST_SECRET_IN_GATEWAY_ENV="gateway-secret-7f3a",
    )
    yield running
    stop_gateway(running)


def _gateway_starter(make_dir: Callable[[], Path]) -> Iterator[Callable[..., Gateway]]:
    started: list[Gateway] = []

    def start(**settings: str) -> Gateway:
        running = start_gateway(make_dir(), **settings)
        started.append(running)
        return running

    yield start
    for running in started:
        stop_gateway(running)


@pytest.fixture
def start_gateway_process(tmp_path: Path) -> Iterator[Callable[..., Gateway]]:
    """start_gateway_process(**settings): a gateway of the test's own (stopped after the test). Every gateway a
    test starts shares tmp_path's state dir, so that a restart finds what its predecessor left."""
    yield from _gateway_starter(lambda: tmp_path)


@pytest.fixture(scope="module")
def start_module_gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[..., Gateway]]:
    """start_module_gateway(**settings): a gateway shared by the tests of one module (stopped after them)."""
    yield from _gateway_starter(lambda: tmp_path_factory.mktemp("gateway"))


@pytest.fixture
def client(gateway: Gateway) -> SandboxClient:
    return gateway.client


@pytest.fixture
def sandbox(client: SandboxClient) -> Iterator[str]:
    """A fresh sandbox (default limits), destroyed after the test."""
    sandbox_id = client.create(job_id="tests").sandbox_id
    yield sandbox_id
    client.destroy(sandbox_id)


def _assert_gateway_serving(gateway: Gateway) -> None:
    """The gateway process is alive, healthy, and still runs a command in a fresh sandbox."""
    assert gateway.process.is_running()
    reply = gateway.client.health.Check(health_pb2.HealthCheckRequest(), timeout=10)
    assert reply.status == health_pb2.HealthCheckResponse.SERVING
    sandbox_id = gateway.client.create(job_id="liveness").sandbox_id
    outcome = gateway.client.exec(sandbox_id, argv=["echo", "still-serving"])
    assert outcome.result.exit_code == 0 and outcome.stdout == b"still-serving\n"
    assert gateway.client.destroy(sandbox_id)


def _host_processes_of_uid(uid: int) -> list[int]:
    """Live (non-zombie) host processes whose real, effective or saved uid is `uid` (an independent /proc scan)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            status = (entry / "status").read_text()
        except OSError:
            continue
        lines = dict(line.split(":\t", 1) for line in status.splitlines() if ":\t" in line)
        if str(uid) in lines.get("Uid", "").split()[:3] and not lines.get("State", "").startswith("Z"):
            found.append(int(entry.name))
    return found


def _rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for {pid}")


@pytest.fixture
def assert_serving() -> Callable[[Gateway], None]:
    """assert_serving(gateway): alive, healthy, and still runs a command in a fresh sandbox."""
    return _assert_gateway_serving


@pytest.fixture
def uid_processes() -> Callable[[int], list[int]]:
    """uid_processes(uid): live host processes running under uid (an independent /proc scan)."""
    return _host_processes_of_uid


def _wait_until_no_processes_of_uid(uid: int) -> bool:
    """True once no process runs under uid (SIGKILLed processes take a moment to exit); False after 30 s."""
    deadline_s = time.monotonic() + 30
    while _host_processes_of_uid(uid):
        if time.monotonic() > deadline_s:
            return False
        time.sleep(0.02)
    return True


@pytest.fixture
def uid_processes_end() -> Callable[[int], bool]:
    """uid_processes_end(uid): waits until no host process runs under uid; False if some never end."""
    return _wait_until_no_processes_of_uid


@pytest.fixture
def rss_bytes() -> Callable[[int], int]:
    """rss_bytes(pid): resident memory of a host process, bytes."""
    return _rss_bytes
