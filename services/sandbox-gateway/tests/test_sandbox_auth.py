"""Bearer tokens on the gateway's control API, over real HTTP and gRPC against a real gateway process: 401 without
a token and 403 with one not accepted on every route; a job's capability opens its own sandboxes and answers for
another job's exactly as for an id that does not exist; the operator token opens everything; probes stay open;
an empty operator token leaves the API open (loopback development)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2
from pydantic import ValidationError

from miles.common.auth import SANDBOX_CAPABILITY, job_capability
from miles.common.grpc_client import create_channel
from miles.proto.sandbox.v1 import sandbox_pb2, sandbox_pb2_grpc
from miles.sandbox.settings import SandboxSettings

if TYPE_CHECKING:
    from conftest import Gateway

pytestmark = pytest.mark.integration

OPERATOR = "operator-token-for-tests-0123456789abcdef"
JOB_A, JOB_B = "job-a", "job-b"
CAP_A = job_capability(OPERATOR, SANDBOX_CAPABILITY, JOB_A)
CAP_B = job_capability(OPERATOR, SANDBOX_CAPABILITY, JOB_B)
FORGED = job_capability("some-other-operator-token-0123456789abcdef", SANDBOX_CAPABILITY, JOB_A)
UNKNOWN_ID = "0123456789abcdef"  # shaped like a sandbox id; never created


def bearer(token: str) -> dict[str, str]:
    return {"authorization": f"Bearer {token}"}


@pytest.fixture(scope="module")
def guarded(start_module_gateway: Callable[..., Gateway]) -> Gateway:
    return start_module_gateway(OPERATOR_TOKEN=OPERATOR, WARM_POOL_SIZE="0")


@pytest.fixture
def http(guarded: Gateway) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=guarded.http_base, timeout=60) as client:
        yield client


def create(http: httpx.Client, token: str, job_id: str) -> str:
    reply = http.post("/v1/sandboxes", json={"job_id": job_id}, headers=bearer(token))
    assert reply.status_code == 201, reply.text
    return str(reply.json()["sandbox_id"])


def calls(sandbox_id: str) -> dict[str, tuple[str, str, dict[str, Any]]]:
    """Every /v1/sandboxes route: name -> (method, path, httpx keyword arguments)."""
    return {
        "create": ("POST", "/v1/sandboxes", {"json": {"job_id": JOB_A}}),
        "list": ("GET", "/v1/sandboxes", {"params": {"job_id": JOB_A}}),
        "exec": ("POST", f"/v1/sandboxes/{sandbox_id}/exec", {"json": {"argv": ["true"], "stream": False}}),
        "write_file": ("PUT", f"/v1/sandboxes/{sandbox_id}/files", {"params": {"path": "f"}, "content": b"x"}),
        "read_file": ("GET", f"/v1/sandboxes/{sandbox_id}/files", {"params": {"path": "f"}}),
        "destroy": ("DELETE", f"/v1/sandboxes/{sandbox_id}", {}),
    }


ROUTES = list(calls(""))
SANDBOX_ROUTES = ["exec", "write_file", "read_file", "destroy"]


def call(http: httpx.Client, route: str, sandbox_id: str, headers: dict[str, str]) -> httpx.Response:
    method, path, kwargs = calls(sandbox_id)[route]
    return http.request(method, path, headers=headers, **kwargs)


@pytest.mark.parametrize("route", ROUTES)
def test_every_route_needs_a_token_and_refuses_one_it_does_not_accept(http: httpx.Client, route: str) -> None:
    sandbox_id = create(http, OPERATOR, JOB_A)
    try:
        for headers in ({}, {"authorization": f"Basic {OPERATOR}"}, {"authorization": "Token abc"}):
            reply = call(http, route, sandbox_id, headers)
            assert reply.status_code == 401, (headers, reply.text)
            assert reply.json()["error"]["code"] == "unauthenticated"
        for token in (FORGED, OPERATOR[:-1], "x" * 43):
            for target in (sandbox_id, UNKNOWN_ID):  # the same answer whether the sandbox exists or not
                reply = call(http, route, target, bearer(token))
                assert reply.status_code == 403, (token, reply.text)
                assert reply.json()["error"]["code"] == "permission_denied"
        assert [info["sandbox_id"] for info in list_of(http, OPERATOR, JOB_A)] == [sandbox_id]  # untouched
    finally:
        http.delete(f"/v1/sandboxes/{sandbox_id}", headers=bearer(OPERATOR))


def list_of(http: httpx.Client, token: str, job_id: str = "") -> list[dict[str, Any]]:
    reply = http.get("/v1/sandboxes", params={"job_id": job_id}, headers=bearer(token))
    assert reply.status_code == 200, reply.text
    return list(reply.json()["sandboxes"])


def test_a_job_capability_opens_its_own_sandboxes_and_no_other_jobs(http: httpx.Client) -> None:
    mine = create(http, CAP_A, JOB_A)
    theirs = create(http, CAP_B, JOB_B)
    try:
        ran = call(http, "exec", mine, bearer(CAP_A))
        assert ran.status_code == 200 and ran.json()["result"]["exit_code"] == 0
        assert call(http, "write_file", mine, bearer(CAP_A)).json() == {"bytes_written": 1}
        assert call(http, "read_file", mine, bearer(CAP_A)).content == b"x"
        assert [info["sandbox_id"] for info in list_of(http, CAP_A, JOB_A)] == [mine]
        # Another job's sandbox looks exactly like one that does not exist.
        for route in ("exec", "write_file", "read_file"):
            other = call(http, route, theirs, bearer(CAP_A))
            missing = call(http, route, UNKNOWN_ID, bearer(CAP_A))
            assert other.status_code == missing.status_code == 404, route
            assert other.json()["error"] == {**missing.json()["error"], "message": other.json()["error"]["message"]}
            assert other.json()["error"]["message"].replace(theirs, UNKNOWN_ID) == missing.json()["error"]["message"]
        assert call(http, "destroy", theirs, bearer(CAP_A)).json() == {"destroyed": False}
        assert call(http, "destroy", UNKNOWN_ID, bearer(CAP_A)).json() == {"destroyed": False}
        assert call(http, "exec", theirs, bearer(CAP_B)).status_code == 200  # not destroyed
        # A job names only itself: Create and List for another job, or List of every job, are refused.
        for reply in (
            http.post("/v1/sandboxes", json={"job_id": JOB_B}, headers=bearer(CAP_A)),
            http.get("/v1/sandboxes", params={"job_id": JOB_B}, headers=bearer(CAP_A)),
            http.get("/v1/sandboxes", headers=bearer(CAP_A)),
        ):
            assert reply.status_code == 403, reply.text
        # Its last sandbox gone, a job's token is still told "not found", not "not accepted".
        assert call(http, "destroy", mine, bearer(CAP_A)).json() == {"destroyed": True}
        assert call(http, "destroy", mine, bearer(CAP_A)).json() == {"destroyed": False}
        assert call(http, "exec", mine, bearer(CAP_A)).status_code == 404
    finally:
        for sandbox_id in (mine, theirs):
            http.delete(f"/v1/sandboxes/{sandbox_id}", headers=bearer(OPERATOR))


def test_the_operator_token_sees_and_acts_on_every_job(http: httpx.Client) -> None:
    of_a, of_b = create(http, CAP_A, JOB_A), create(http, OPERATOR, JOB_B)
    listed = {info["sandbox_id"]: info["job_id"] for info in list_of(http, OPERATOR)}
    assert listed == {of_a: JOB_A, of_b: JOB_B}
    assert [info["sandbox_id"] for info in list_of(http, CAP_B, JOB_B)] == [of_b]  # made for B by the operator
    assert call(http, "exec", of_a, bearer(OPERATOR)).json()["result"]["exit_code"] == 0
    assert call(http, "write_file", of_a, bearer(OPERATOR)).status_code == 200
    assert call(http, "read_file", of_a, bearer(CAP_A)).content == b"x"
    for sandbox_id in (of_a, of_b):
        assert call(http, "destroy", sandbox_id, bearer(OPERATOR)).json() == {"destroyed": True}
    assert list_of(http, OPERATOR) == []


def test_probes_stay_open_and_the_openapi_documents_the_auth_answers(guarded: Gateway, http: httpx.Client) -> None:
    for probe in ("/healthz", "/readyz", "/metrics"):
        assert http.get(probe).status_code == 200, probe
    reply = guarded.client.health.Check(health_pb2.HealthCheckRequest(), timeout=10)
    assert reply.status == health_pb2.HealthCheckResponse.SERVING
    paths = http.get("/openapi.json").json()["paths"]
    operations = {
        (method.upper(), path): operation
        for path, methods in paths.items()
        if path.startswith("/v1/sandboxes")
        for method, operation in methods.items()
    }
    assert len(operations) == len(ROUTES)
    for (method, path), operation in operations.items():
        expected = {"401", "403", "404"} if "{sandbox_id}" in path and method != "DELETE" else {"401", "403"}
        assert expected <= set(operation["responses"]), (method, path)
        headers = {param["name"] for param in operation["parameters"] if param["in"] == "header"}
        assert headers == {"authorization"}, (method, path)


def grpc_calls(sandbox_id: str) -> dict[str, Callable[..., Any]]:
    """Every SandboxService RPC: name -> call(stub, metadata) returning its response (Exec: every event)."""
    return {
        "Create": lambda stub, md: stub.Create(sandbox_pb2.CreateRequest(job_id=JOB_A), metadata=md, timeout=30),
        "List": lambda stub, md: stub.List(sandbox_pb2.ListRequest(job_id=JOB_A), metadata=md, timeout=30),
        "Exec": lambda stub, md: list(
            stub.Exec(sandbox_pb2.ExecRequest(sandbox_id=sandbox_id, shell="true"), metadata=md, timeout=30)
        ),
        "WriteFile": lambda stub, md: stub.WriteFile(
            sandbox_pb2.WriteFileRequest(sandbox_id=sandbox_id, path="f", data=b"x"), metadata=md, timeout=30
        ),
        "ReadFile": lambda stub, md: stub.ReadFile(
            sandbox_pb2.ReadFileRequest(sandbox_id=sandbox_id, path="f"), metadata=md, timeout=30
        ),
        "Destroy": lambda stub, md: stub.Destroy(
            sandbox_pb2.DestroyRequest(sandbox_id=sandbox_id), metadata=md, timeout=30
        ),
    }


def grpc_code(rpc: Callable[..., Any], stub: Any, metadata: tuple[tuple[str, str], ...]) -> grpc.StatusCode:
    try:
        rpc(stub, metadata)
    except grpc.RpcError as error:
        return error.code()  # type: ignore[no-any-return]
    return grpc.StatusCode.OK


def test_grpc_calls_are_checked_like_http_ones(guarded: Gateway, http: httpx.Client) -> None:
    stub = guarded.client.stub
    theirs = create(http, CAP_B, JOB_B)
    try:
        for name, rpc in grpc_calls(theirs).items():
            assert grpc_code(rpc, stub, ()) == grpc.StatusCode.UNAUTHENTICATED, name
            assert grpc_code(rpc, stub, (("authorization", f"Bearer {FORGED}"),)) == grpc.StatusCode.PERMISSION_DENIED
        with_a = (("authorization", f"Bearer {CAP_A}"),)
        for name in ("Exec", "WriteFile", "ReadFile"):  # B's sandbox, A's token: as if it did not exist
            assert grpc_code(grpc_calls(theirs)[name], stub, with_a) == grpc.StatusCode.NOT_FOUND, name
        assert not grpc_calls(theirs)["Destroy"](stub, with_a).destroyed
        listing_b = sandbox_pb2.ListRequest(job_id=JOB_B)
        with pytest.raises(grpc.RpcError) as refused:
            stub.List(listing_b, metadata=with_a, timeout=30)
        assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
        listed = stub.List(listing_b, metadata=(("authorization", f"Bearer {OPERATOR}"),), timeout=30)
        assert [info.sandbox_id for info in listed.sandboxes] == [theirs]
    finally:
        http.delete(f"/v1/sandboxes/{theirs}", headers=bearer(OPERATOR))


async def test_the_rollout_workers_channel_carries_the_job_capability(guarded: Gateway) -> None:
    """miles.common's create_channel(bearer_token=...) is how rollout workers call the gateway."""
    channel = create_channel(
        guarded.grpc_target,
        service_names=[sandbox_pb2.DESCRIPTOR.services_by_name["SandboxService"].full_name],
        bearer_token=CAP_A,
    )
    stub = sandbox_pb2_grpc.SandboxServiceStub(channel)  # type: ignore[no-untyped-call]
    try:
        created = await stub.Create(sandbox_pb2.CreateRequest(job_id=JOB_A), timeout=30)
        events = [
            event
            async for event in stub.Exec(
                sandbox_pb2.ExecRequest(sandbox_id=created.sandbox_id, shell="echo ok"), timeout=30
            )
        ]
        assert events[0].output.data == b"ok\n" and events[-1].result.exit_code == 0
        assert (await stub.Destroy(sandbox_pb2.DestroyRequest(sandbox_id=created.sandbox_id), timeout=30)).destroyed
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await stub.Create(sandbox_pb2.CreateRequest(job_id=JOB_B), timeout=30)
        assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
    finally:
        await channel.close()


def test_an_empty_operator_token_leaves_the_api_open(start_module_gateway: Callable[..., Gateway]) -> None:
    gateway = start_module_gateway(WARM_POOL_SIZE="0")
    with httpx.Client(base_url=gateway.http_base, timeout=60) as http:
        for headers in ({}, bearer(FORGED)):
            created = http.post("/v1/sandboxes", json={"job_id": JOB_A}, headers=headers)
            assert created.status_code == 201, created.text
            sandbox_id = created.json()["sandbox_id"]
            assert len(http.get("/v1/sandboxes", headers=headers).json()["sandboxes"]) == 1
            assert http.delete(f"/v1/sandboxes/{sandbox_id}", headers=headers).json() == {"destroyed": True}
    assert gateway.client.list("") == []  # gRPC without metadata too


def test_operator_token_is_required_off_loopback_and_must_be_long() -> None:
    with pytest.raises(ValidationError, match=r"operator_token is required when host is '0\.0\.0\.0'"):
        SandboxSettings(host="0.0.0.0")
    with pytest.raises(ValidationError, match="operator_token must have at least 32 characters"):
        SandboxSettings(operator_token="short")
    assert SandboxSettings(host="0.0.0.0", operator_token=OPERATOR).operator_token.get_secret_value() == OPERATOR
    assert SandboxSettings().operator_token.get_secret_value() == ""  # loopback: open
