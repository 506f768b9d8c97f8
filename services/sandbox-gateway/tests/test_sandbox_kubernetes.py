"""The Kubernetes backend through the gateway core, against a small fake Kubernetes API in this file.

No API server can run here, so the fake (aiohttp) implements what the backend uses: pods and NetworkPolicies
(create / read / list / delete, with a pod going Pending -> Running) and the exec websocket with the
v5.channel.k8s.io framing, where each "exec" runs the command as a local process with /workspace mapped to a
directory of the fake pod. Every object the backend creates is validated by kubernetes-validate against the
Kubernetes 1.34 schemas (strict) — an invalid one is refused with 422, as a real API server would.
"""

from __future__ import annotations

import asyncio
import json
import signal
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
from aiohttp import WSMsgType, web

from miles.common.telemetry import Metrics
from miles.common.testing import free_port
from miles.sandbox.core import SandboxGateway
from miles.sandbox.errors import BackendUnusableError, InvalidSandboxRequestError, SandboxGoneError
from miles.sandbox.kubernetes_backend import KubernetesBackend
from miles.sandbox.metrics import SandboxMetrics
from miles.sandbox.models import CreateParams, ExecParams, ExecResult, LimitKind, Limits, NetworkMode, NetworkSpec
from miles.sandbox.settings import SandboxSettings
from miles.sandbox.warm_pool import WarmPool

pytestmark = pytest.mark.integration

TOKEN = "test-token"
NAMESPACE = "sandboxes"


def _status(code: int, reason: str, message: str) -> web.Response:
    body = {"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": reason, "message": message}
    return web.json_response({**body, "code": code}, status=code)


@dataclass
class FakeKubernetes:
    """In-memory pods and NetworkPolicies, plus exec, behind the paths the official client calls."""

    root: Path
    pods: dict[str, dict[str, Any]] = field(default_factory=dict)
    policies: dict[str, dict[str, Any]] = field(default_factory=dict)
    created: list[dict[str, Any]] = field(default_factory=list)
    execs: list[list[str]] = field(default_factory=list)

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._auth])
        pods = f"/api/v1/namespaces/{NAMESPACE}/pods"
        policies = f"/apis/networking.k8s.io/v1/namespaces/{NAMESPACE}/networkpolicies"
        app.router.add_post(pods, self.create_pod)
        app.router.add_get(pods, self.list_pods)
        app.router.add_get(pods + "/{name}", self.read_pod)
        app.router.add_delete(pods + "/{name}", self.delete_pod)
        app.router.add_get(pods + "/{name}/exec", self.exec_pod)
        app.router.add_post(policies, self.create_policy)
        app.router.add_delete(policies + "/{name}", self.delete_policy)
        return app

    @web.middleware
    async def _auth(self, request: web.Request, handler: Any) -> web.StreamResponse:
        if request.headers.get("Authorization") != f"Bearer {TOKEN}":
            return _status(401, "Unauthorized", "bad token")
        response: web.StreamResponse = await handler(request)
        return response

    async def _validated(self, request: web.Request) -> dict[str, Any] | web.Response:
        body: dict[str, Any] = await request.json()
        try:
            kubernetes_validate.validate(body, "1.34.0", strict=True)
        except kubernetes_validate.ValidationError as exc:
            return _status(422, "Invalid", f"{body.get('kind')} is invalid: {exc.message}")
        if body["metadata"].get("namespace") != NAMESPACE:
            return _status(400, "BadRequest", "namespace mismatch")
        self.created.append(body)
        return body

    async def create_pod(self, request: web.Request) -> web.Response:
        body = await self._validated(request)
        if isinstance(body, web.Response):
            return body
        name = body["metadata"]["name"]
        (self.root / name).mkdir()
        self.pods[name] = {**body, "status": {"phase": "Pending"}}
        return web.json_response(self.pods[name], status=201)

    async def list_pods(self, request: web.Request) -> web.Response:
        items = list(self.pods.values())
        return web.json_response({"kind": "PodList", "apiVersion": "v1", "metadata": {}, "items": items})

    async def read_pod(self, request: web.Request) -> web.Response:
        pod = self.pods.get(request.match_info["name"])
        if pod is None:
            return _status(404, "NotFound", "pod not found")
        response = web.json_response(pod)
        pod["status"] = {"phase": "Running"}  # Pending on the first read, Running afterwards
        return response

    async def delete_pod(self, request: web.Request) -> web.Response:
        pod = self.pods.pop(request.match_info["name"], None)
        return web.json_response(pod) if pod is not None else _status(404, "NotFound", "pod not found")

    async def create_policy(self, request: web.Request) -> web.Response:
        body = await self._validated(request)
        if isinstance(body, web.Response):
            return body
        self.policies[body["metadata"]["name"]] = body
        return web.json_response(body, status=201)

    async def delete_policy(self, request: web.Request) -> web.Response:
        policy = self.policies.pop(request.match_info["name"], None)
        return web.json_response(policy) if policy is not None else _status(404, "NotFound", "policy not found")

    async def exec_pod(self, request: web.Request) -> web.StreamResponse:
        name = request.match_info["name"]
        if name not in self.pods:
            return _status(404, "NotFound", "pod not found")
        command = request.query.getall("command")
        self.execs.append(command)
        pod_dir = str(self.root / name)
        local_command = [arg.replace("/workspace", pod_dir) for arg in command]
        socket = web.WebSocketResponse(protocols=("v5.channel.k8s.io", "v4.channel.k8s.io"))
        await socket.prepare(request)
        wants_stdin = request.query.get("stdin") == "true"
        process = await asyncio.create_subprocess_exec(
            *local_command,
            stdin=asyncio.subprocess.PIPE if wants_stdin else asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )

        async def pump(stream: asyncio.StreamReader, channel: int) -> None:
            while chunk := await stream.read(65536):
                await socket.send_bytes(bytes([channel]) + chunk)

        async def feed_stdin() -> None:
            async for message in socket:
                if message.type != WSMsgType.BINARY or process.stdin is None:
                    continue
                data: bytes = message.data
                if data[:1] == b"\x00":
                    process.stdin.write(data[1:])
                    await process.stdin.drain()
                elif data == b"\xff\x00":  # v5: close stdin
                    process.stdin.close()

        feeder = asyncio.create_task(feed_stdin())
        assert process.stdout is not None and process.stderr is not None
        await asyncio.gather(pump(process.stdout, 1), pump(process.stderr, 2))
        code = await process.wait()
        status: dict[str, Any] = {"metadata": {}, "status": "Success"}
        if code != 0:
            status = {
                "metadata": {},
                "status": "Failure",
                "reason": "NonZeroExitCode",
                "details": {"causes": [{"reason": "ExitCode", "message": str(code if code > 0 else 128 - code)}]},
            }
        await socket.send_bytes(b"\x03" + json.dumps(status).encode())
        feeder.cancel()
        await socket.close()
        return socket


@pytest.fixture
async def fake_kubernetes(tmp_path: Path) -> AsyncIterator[tuple[FakeKubernetes, str]]:
    fake = FakeKubernetes(tmp_path / "pods")
    fake.root.mkdir()
    runner = web.AppRunner(fake.app())
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    yield fake, f"http://127.0.0.1:{port}"
    await runner.cleanup()


def _settings(api_url: str, **overrides: Any) -> SandboxSettings:
    kubernetes = {
        "api_url": api_url,
        "bearer_token": TOKEN,
        "namespace": NAMESPACE,
        "poll_interval_s": 0.05,
        "runtime_class_name": "gvisor",
    }
    return SandboxSettings(backend="kubernetes", kubernetes=kubernetes, warm_pool_size=0, **overrides)


@pytest.fixture
async def gateway(fake_kubernetes: tuple[FakeKubernetes, str]) -> AsyncIterator[SandboxGateway]:
    _, api_url = fake_kubernetes
    settings = _settings(api_url)
    gateway = SandboxGateway(settings, KubernetesBackend(settings), SandboxMetrics(Metrics("sandbox")))
    await gateway.start()
    yield gateway
    await gateway.close()


async def _run(gateway: SandboxGateway, sandbox_id: str, **params: Any) -> tuple[bytes, bytes, ExecResult]:
    output: dict[str, bytes] = {"stdout": b"", "stderr": b""}
    result = None
    async for event in gateway.open_exec(sandbox_id, ExecParams(**params)):
        if isinstance(event, ExecResult):
            result = event
        else:
            output[event.stream] += event.data
    assert result is not None
    return output["stdout"], output["stderr"], result


async def test_create_makes_a_fenced_hardened_pod(
    gateway: SandboxGateway, fake_kubernetes: tuple[FakeKubernetes, str]
) -> None:
    fake, _ = fake_kubernetes
    created = await gateway.create(CreateParams(job_id="j", limits=Limits(memory_bytes=256 << 20)))
    assert created.backend == "kubernetes" and not created.warm
    policy, pod = fake.created  # the NetworkPolicy first: the pod never runs unfenced
    assert policy["kind"] == "NetworkPolicy" and pod["kind"] == "Pod"
    assert policy["spec"]["podSelector"]["matchLabels"] == {"miles.io/sandbox-id": created.sandbox_id}
    assert policy["spec"]["policyTypes"] == ["Ingress", "Egress"] and policy["spec"]["egress"] == []
    spec = pod["spec"]
    container = spec["containers"][0]
    assert spec["runtimeClassName"] == "gvisor" and spec["automountServiceAccountToken"] is False
    assert spec["securityContext"]["runAsNonRoot"] is True
    assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert container["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    assert container["resources"]["limits"]["memory"] == str(256 << 20)
    assert spec["activeDeadlineSeconds"] == 86400


async def test_egress_allowlist_becomes_network_policy_ip_blocks(
    gateway: SandboxGateway, fake_kubernetes: tuple[FakeKubernetes, str]
) -> None:
    fake, _ = fake_kubernetes
    network = NetworkSpec(NetworkMode.EGRESS_ALLOWLIST, ("10.0.0.0/8", "1.2.3.4/32:443"))
    await gateway.create(CreateParams(network=network))
    egress = fake.created[0]["spec"]["egress"]
    assert egress == [
        {"to": [{"ipBlock": {"cidr": "10.0.0.0/8"}}]},
        {
            "to": [{"ipBlock": {"cidr": "1.2.3.4/32"}}],
            "ports": [{"protocol": "TCP", "port": 443}, {"protocol": "UDP", "port": 443}],
        },
    ]


async def test_exec_streams_output_exit_code_stdin_and_env(gateway: SandboxGateway) -> None:
    sandbox_id = (await gateway.create(CreateParams(env={"GREETING": "hello"}))).sandbox_id
    script = 'echo "$GREETING"; cat; echo err >&2; exit 3'
    stdout, stderr, result = await _run(gateway, sandbox_id, shell=script, stdin=b"in")
    assert stdout == b"hello\nin" and stderr == b"err\n"
    assert result.exit_code == 3 and not result.limits_hit


async def test_exec_timeout_is_enforced_in_the_pod(
    gateway: SandboxGateway, fake_kubernetes: tuple[FakeKubernetes, str]
) -> None:
    fake, _ = fake_kubernetes
    sandbox_id = (await gateway.create(CreateParams())).sandbox_id
    _, _, result = await _run(gateway, sandbox_id, argv=("sleep", "30"), timeout_s=0.5)
    assert result.signal == signal.SIGKILL and LimitKind.TIMEOUT in result.limits_hit
    assert fake.execs[-1][:1] == ["prlimit"] and fake.execs[-1][7:11] == ["timeout", "-s", "KILL", "0.5"]


async def test_output_is_capped(gateway: SandboxGateway) -> None:
    sandbox_id = (await gateway.create(CreateParams(limits=Limits(max_output_bytes=1000)))).sandbox_id
    stdout, _, result = await _run(gateway, sandbox_id, shell="head -c 100000 /dev/zero", timeout_s=5)
    assert len(stdout) == 1000 and result.limits_hit == (LimitKind.OUTPUT,)


async def test_files_go_through_exec_in_the_pod(gateway: SandboxGateway) -> None:
    sandbox_id = (await gateway.create(CreateParams())).sandbox_id
    assert await gateway.write_file(sandbox_id, "dir/a.txt", b"payload", 0o600) == 7
    stdout, _, _ = await _run(gateway, sandbox_id, argv=("cat", "dir/a.txt"))
    assert stdout == b"payload"
    content = await gateway.read_file(sandbox_id, "/workspace/dir/a.txt", 3)
    assert (content.data, content.size_bytes, content.truncated) == (b"pay", 7, True)
    with pytest.raises(InvalidSandboxRequestError) as error:
        await gateway.read_file(sandbox_id, "dir", 10)
    assert error.value.field == "path"


async def test_destroy_deletes_the_pod_and_its_policy(
    gateway: SandboxGateway, fake_kubernetes: tuple[FakeKubernetes, str]
) -> None:
    fake, _ = fake_kubernetes
    sandbox_id = (await gateway.create(CreateParams())).sandbox_id
    assert fake.pods and fake.policies
    assert await gateway.destroy(sandbox_id)
    assert fake.pods == {} and fake.policies == {}


async def test_a_pod_deleted_behind_the_gateways_back_is_gone(
    gateway: SandboxGateway, fake_kubernetes: tuple[FakeKubernetes, str]
) -> None:
    fake, _ = fake_kubernetes
    sandbox_id = (await gateway.create(CreateParams())).sandbox_id
    fake.pods.clear()
    with pytest.raises(SandboxGoneError):
        await _run(gateway, sandbox_id, argv=("true",))
    assert await gateway.reap_once() == [sandbox_id]


async def _pool_filled(pool: WarmPool) -> None:
    while True:  # the background filler refills it; the test's own timeout bounds the wait
        if len(pool) >= 1:
            return
        await asyncio.sleep(0.02)


async def test_warm_pool_pods_are_adopted_when_they_fit(fake_kubernetes: tuple[FakeKubernetes, str]) -> None:
    _, api_url = fake_kubernetes
    settings = _settings(api_url).model_copy(update={"warm_pool_size": 1})
    gateway = SandboxGateway(settings, KubernetesBackend(settings), SandboxMetrics(Metrics("sandbox")))
    await gateway.start()
    try:
        assert gateway.pool is not None
        pool = gateway.pool
        await _pool_filled(pool)
        assert (await gateway.create(CreateParams())).warm  # default limits: fits the pooled pod
        await _pool_filled(pool)
        other_memory = await gateway.create(CreateParams(limits=Limits(memory_bytes=64 << 20)))
        assert not other_memory.warm  # a pod's memory limit is fixed: started cold instead
    finally:
        await gateway.close()


async def test_start_fails_clearly_without_a_reachable_api(tmp_path: Path) -> None:
    settings = _settings(f"http://127.0.0.1:{free_port()}")
    with pytest.raises(BackendUnusableError) as error:
        await KubernetesBackend(settings).start()
    assert "cannot list pods" in error.value.message
