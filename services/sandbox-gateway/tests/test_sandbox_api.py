"""The gateway's API over gRPC and the HTTP facade, against a real gateway process with the local backend:
the operations, streaming, bad input (NOT_FOUND / 404, oversized writes, invalid limits naming the field) and
100 concurrent execs.
"""

from __future__ import annotations

import asyncio
import base64
import json
from collections.abc import Callable
from typing import TYPE_CHECKING

import grpc
import httpx
import pytest

from miles.proto.sandbox.v1 import sandbox_pb2, sandbox_pb2_grpc

if TYPE_CHECKING:
    from conftest import Gateway, SandboxClient

pytestmark = pytest.mark.integration


def _error_field(error: grpc.RpcError) -> str | None:
    return dict(error.trailing_metadata() or ()).get("miles-error-field")  # type: ignore[attr-defined]


def test_exec_streams_stdout_and_stderr_and_ends_with_a_result(client: SandboxClient, sandbox: str) -> None:
    outcome = client.exec(sandbox, shell="echo one; sleep 0.3; echo two >&2; exit 7")
    assert outcome.stdout == b"one\n" and outcome.stderr == b"two\n"
    assert [chunk.data for chunk in outcome.chunks] == [b"one\n", b"two\n"]  # as they came, not batched at the end
    assert outcome.result.exit_code == 7 and outcome.result.signal == 0
    assert outcome.result.stdout_bytes == 4 and outcome.result.stderr_bytes == 4
    assert outcome.result.wall_s >= 0.3 and not outcome.limits_hit


def test_exec_gets_stdin_cwd_and_env(client: SandboxClient) -> None:
    sandbox = client.create(job_id="tests", env={"FROM_SANDBOX": "s", "SHARED": "sandbox"}).sandbox_id
    try:
        assert client.exec(sandbox, argv=["mkdir", "-p", "sub/dir"]).result.exit_code == 0
        outcome = client.exec(
            sandbox,
            shell='cat; echo; pwd; echo "$FROM_SANDBOX $SHARED $HOME"',
            stdin=b"piped input",
            cwd="sub/dir",
            env={"SHARED": "exec"},
        )
        assert outcome.text == "piped input\n/workspace/sub/dir\ns exec /workspace\n"
    finally:
        client.destroy(sandbox)


def test_files_round_trip_and_are_visible_to_execs(client: SandboxClient, sandbox: str) -> None:
    assert client.write(sandbox, "pkg/main.py", b"print('hi from a file')\n", mode=0o755) == 24
    assert client.exec(sandbox, argv=["python3", "pkg/main.py"]).stdout == b"hi from a file\n"
    assert client.exec(sandbox, shell="stat -c %a pkg/main.py").text == "755\n"
    client.exec(sandbox, shell="head -c 5000 /dev/zero > big.bin")
    whole = client.read(sandbox, "/workspace/big.bin")
    assert (len(whole.data), whole.size_bytes, whole.truncated) == (5000, 5000, False)
    part = client.read(sandbox, "big.bin", max_bytes=100)
    assert (len(part.data), part.size_bytes, part.truncated) == (100, 5000, True)


def test_list_shows_live_sandboxes_of_a_job(client: SandboxClient) -> None:
    first = client.create(job_id="list-job", ttl_s=30, limits={"memory_bytes": 64 << 20}).sandbox_id
    second = client.create(job_id="list-job").sandbox_id
    try:
        infos = {info.sandbox_id: info for info in client.list("list-job")}
        assert set(infos) == {first, second}
        assert infos[first].ttl_s == 30 and infos[first].limits.memory_bytes == 64 << 20
        assert infos[first].backend == "local" and infos[first].network_mode == sandbox_pb2.NETWORK_MODE_NONE
        assert first in {info.sandbox_id for info in client.list()}
    finally:
        client.destroy(first)
        client.destroy(second)
    assert client.list("list-job") == []


@pytest.mark.parametrize(
    "call",
    [
        lambda c: c.exec("0123456789abcdef", argv=["true"]),
        lambda c: c.write("0123456789abcdef", "a", b"x"),
        lambda c: c.read("0123456789abcdef", "a"),
    ],
    ids=["exec", "write", "read"],
)
def test_unknown_sandbox_is_not_found(client: SandboxClient, call: object) -> None:
    with pytest.raises(grpc.RpcError) as error:
        call(client)  # type: ignore[operator]
    assert error.value.code() == grpc.StatusCode.NOT_FOUND
    assert _error_field(error.value) == "sandbox_id"
    assert client.destroy("0123456789abcdef") is False


@pytest.mark.parametrize(
    ("limits", "field"),
    [
        ({"memory_bytes": -1}, "limits.memory_bytes"),
        ({"memory_bytes": 1 << 40}, "limits.memory_bytes"),
        ({"cpu_s": float("nan")}, "limits.cpu_s"),
        ({"max_processes": 100000}, "limits.max_processes"),
        ({"max_output_bytes": -5}, "limits.max_output_bytes"),
    ],
)
def test_invalid_limits_are_rejected_naming_the_field(
    client: SandboxClient, limits: dict[str, float], field: str
) -> None:
    with pytest.raises(grpc.RpcError) as error:
        client.create(job_id="bad", limits=limits)
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert _error_field(error.value) == field
    assert field in (error.value.details() or "")


def test_other_bad_input_is_rejected_naming_the_field(client: SandboxClient, sandbox: str) -> None:
    cases = [
        (lambda: client.create(template="nope"), "template"),
        (lambda: client.create(ttl_s=-1), "ttl_s"),
        (
            lambda: client.create(network=sandbox_pb2.NetworkPolicy(mode=2, egress_allowlist=["1.2.3.4/32"])),
            "network.mode",
        ),
        (lambda: client.exec(sandbox, argv=[]), "command"),
        (lambda: client.exec(sandbox, argv=["true"], timeout_s=-1), "timeout_s"),
        (lambda: client.exec(sandbox, argv=["true"], cwd="../.."), "cwd"),
        (lambda: client.exec(sandbox, argv=["true"], env={"A=B": "x"}), "env"),
        (lambda: client.write(sandbox, "../escape", b"x"), "path"),
        (lambda: client.write(sandbox, "a", b"x", mode=0o4755), "mode"),
    ]
    for call, field in cases:
        with pytest.raises(grpc.RpcError) as error:
            call()
        assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT, field
        assert _error_field(error.value) == field


def test_oversized_file_write_is_rejected(client: SandboxClient, sandbox: str) -> None:
    too_big = b"x" * (16 * 1024 * 1024 + 1)  # max_write_bytes + 1
    with pytest.raises(grpc.RpcError) as error:
        client.write(sandbox, "big", too_big)
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert _error_field(error.value) == "data"
    with pytest.raises(grpc.RpcError) as error:
        client.read(sandbox, "big")
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT  # nothing was written


async def test_a_hundred_concurrent_execs_all_succeed(gateway: Gateway) -> None:
    async with grpc.aio.insecure_channel(gateway.grpc_target) as channel:
        stub = sandbox_pb2_grpc.SandboxServiceStub(channel)
        sandboxes = [(await stub.Create(sandbox_pb2.CreateRequest(job_id="concurrency"))).sandbox_id for _ in range(10)]

        async def run(index: int) -> tuple[bytes, int]:
            request = sandbox_pb2.ExecRequest(sandbox_id=sandboxes[index % 10], timeout_s=60)
            request.argv.args.extend(["echo", f"exec-{index}"])
            output, code = b"", None
            async for event in stub.Exec(request, timeout=120):
                if event.HasField("output"):
                    output += event.output.data
                else:
                    code = event.result.exit_code
            assert code is not None
            return output, code

        try:
            results = await asyncio.gather(*(run(index) for index in range(100)))
        finally:
            for sandbox_id in sandboxes:
                await stub.Destroy(sandbox_pb2.DestroyRequest(sandbox_id=sandbox_id))
    assert results == [(f"exec-{index}\n".encode(), 0) for index in range(100)]


def test_a_cancelled_exec_call_kills_its_processes(
    gateway: Gateway, client: SandboxClient, sandbox: str, uid_processes_end: Callable[[int], bool]
) -> None:
    uid = int(client.exec(sandbox, argv=["id", "-u"]).text)
    request = sandbox_pb2.ExecRequest(sandbox_id=sandbox, shell="echo started; exec sleep 120", timeout_s=300)
    call = client.stub.Exec(request, timeout=300)
    first = next(call)
    assert first.output.data == b"started\n"
    call.cancel()  # the agent went away mid-exec
    assert uid_processes_end(uid)
    assert client.exec(sandbox, argv=["echo", "ok"]).stdout == b"ok\n"
    assert [info.active_execs for info in client.list("tests")] == [0]


# -- HTTP facade ---------------------------------------------------------------------------------------------


def test_http_facade_runs_the_same_operations(gateway: Gateway) -> None:
    with httpx.Client(base_url=gateway.http_base, timeout=60) as http:
        created = http.post("/v1/sandboxes", json={"job_id": "http", "limits": {"max_output_bytes": 4096}})
        assert created.status_code == 201, created.text
        sandbox_id = created.json()["sandbox_id"]
        assert created.json()["limits"]["max_output_bytes"] == 4096
        files_url, exec_url = f"/v1/sandboxes/{sandbox_id}/files", f"/v1/sandboxes/{sandbox_id}/exec"
        written = http.put(files_url, params={"path": "in.txt", "mode": "600"}, content=b"abc")
        assert written.json() == {"bytes_written": 3}
        with http.stream("POST", exec_url, json={"shell": "cat in.txt; echo e >&2"}) as streamed:
            assert streamed.headers["content-type"].startswith("application/x-ndjson")
            lines = [json.loads(line) for line in streamed.iter_lines() if line]
        assert [line["type"] for line in lines] == ["output", "output", "result"]
        assert base64.b64decode(lines[0]["data_b64"]) == b"abc" and lines[1]["stream"] == "stderr"
        assert lines[-1]["exit_code"] == 0
        collected = http.post(
            f"/v1/sandboxes/{sandbox_id}/exec", json={"argv": ["wc", "-c"], "stdin": "12345", "stream": False}
        ).json()
        assert collected["stdout"] == "5\n" and collected["result"]["limits_hit"] == []
        read = http.get(f"/v1/sandboxes/{sandbox_id}/files", params={"path": "in.txt", "max_bytes": 2})
        assert read.content == b"ab" and read.headers["x-miles-file-size"] == "3"
        assert read.headers["x-miles-truncated"] == "true"
        listed = http.get("/v1/sandboxes", params={"job_id": "http"}).json()["sandboxes"]
        assert [info["sandbox_id"] for info in listed] == [sandbox_id]
        assert http.delete(f"/v1/sandboxes/{sandbox_id}").json() == {"destroyed": True}
        assert http.delete(f"/v1/sandboxes/{sandbox_id}").json() == {"destroyed": False}


def test_http_facade_bad_input(gateway: Gateway, sandbox: str) -> None:
    with httpx.Client(base_url=gateway.http_base, timeout=60) as http:
        missing = http.post("/v1/sandboxes/0123456789abcdef/exec", json={"argv": ["true"]})
        assert missing.status_code == 404
        assert missing.json()["error"]["field"] == "sandbox_id"
        assert http.get("/v1/sandboxes/0123456789abcdef/files", params={"path": "a"}).status_code == 404
        bad_limits = http.post("/v1/sandboxes", json={"limits": {"max_open_files": -3}})
        assert bad_limits.status_code == 400
        assert bad_limits.json()["error"]["field"] == "limits.max_open_files"
        too_big = http.put(
            f"/v1/sandboxes/{sandbox}/files", params={"path": "big"}, content=b"x" * (16 * 1024 * 1024 + 1)
        )
        assert too_big.status_code == 413
        assert too_big.json()["error"]["field"] == "data"
        unknown_field = http.post("/v1/sandboxes", json={"limitz": {}})
        assert unknown_field.status_code == 422
        both = http.post(f"/v1/sandboxes/{sandbox}/exec", json={"argv": ["true"], "shell": "true"})
        assert both.status_code == 400 and both.json()["error"]["field"] == "command"


def test_metrics_cover_sandboxes_execs_and_startup(gateway: Gateway, client: SandboxClient, sandbox: str) -> None:
    client.exec(sandbox, argv=["true"])
    client.exec(sandbox, shell="sleep 5", timeout_s=0.2)
    text = httpx.get(f"{gateway.http_base}/metrics").text
    for name in (
        'miles_sandbox_live_sandboxes{backend="local"}',
        'miles_sandbox_warm_pool_sandboxes{backend="local"}',
        'miles_sandbox_exec_duration_seconds_count{backend="local"}',
        'miles_sandbox_exec_timeouts_total{backend="local"}',
        'miles_sandbox_limit_kills_total{backend="local",limit="timeout"}',
        'miles_sandbox_startup_duration_seconds_bucket{backend="local",le="0.01",source="warm"}',
        'miles_sandbox_execs_total{backend="local",outcome="exit0"}',
    ):
        assert name in text, name
    live = next(line for line in text.splitlines() if line.startswith("miles_sandbox_live_sandboxes{"))
    assert float(live.split()[-1]) >= 1
