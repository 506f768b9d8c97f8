"""The remote-provider backend through the gateway core: against a fake provider in this file (the sandbox
HTTP API with bearer auth, canned commands), and against a real gateway's HTTP facade as the provider."""

from __future__ import annotations

import base64
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import pytest
from aiohttp import web

from miles.common.errors import UpstreamError
from miles.common.telemetry import Metrics
from miles.common.testing import free_port
from miles.sandbox.core import SandboxGateway
from miles.sandbox.errors import BackendUnusableError, SandboxGoneError
from miles.sandbox.metrics import SandboxMetrics
from miles.sandbox.models import CreateParams, ExecParams, ExecResult, Limits, NetworkMode, NetworkSpec
from miles.sandbox.remote_backend import RemoteBackend
from miles.sandbox.settings import SandboxSettings

if TYPE_CHECKING:
    from conftest import Gateway

pytestmark = pytest.mark.integration

API_KEY = "provider-key"


@dataclass
class FakeProvider:
    """A provider speaking the sandbox HTTP API. Commands: `echo ARGS`, `cat` (stdin back), `flood N`,
    `broken` (an error line mid-stream); anything else exits 127."""

    sandboxes: dict[str, dict[str, bytes]] = field(default_factory=dict)
    create_bodies: list[dict[str, Any]] = field(default_factory=list)
    exec_bodies: list[dict[str, Any]] = field(default_factory=list)

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._auth])
        app.router.add_post("/v1/sandboxes", self.create)
        app.router.add_get("/v1/sandboxes", self.list)
        app.router.add_post("/v1/sandboxes/{id}/exec", self.exec)
        app.router.add_put("/v1/sandboxes/{id}/files", self.write)
        app.router.add_get("/v1/sandboxes/{id}/files", self.read)
        app.router.add_delete("/v1/sandboxes/{id}", self.destroy)
        return app

    @web.middleware
    async def _auth(self, request: web.Request, handler: Any) -> web.StreamResponse:
        if request.headers.get("Authorization") != f"Bearer {API_KEY}":
            return web.json_response({"error": {"code": "unauthenticated", "message": "bad key"}}, status=401)
        response: web.StreamResponse = await handler(request)
        return response

    def _files(self, request: web.Request) -> dict[str, bytes] | None:
        return self.sandboxes.get(request.match_info["id"])

    async def create(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.create_bodies.append(body)
        provider_id = f"prov-{len(self.create_bodies)}"
        self.sandboxes[provider_id] = {}
        return web.json_response({"sandbox_id": provider_id}, status=201)

    async def list(self, request: web.Request) -> web.Response:
        return web.json_response({"sandboxes": []})

    async def exec(self, request: web.Request) -> web.StreamResponse:
        if self._files(request) is None:
            return web.json_response({"error": {"code": "not_found", "message": "no such sandbox"}}, status=404)
        body = await request.json()
        self.exec_bodies.append(body)
        response = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
        await response.prepare(request)

        async def send(record: dict[str, Any]) -> None:
            await response.write(json.dumps(record).encode() + b"\n")

        argv = body["argv"]
        exit_code = 0
        if argv[0] == "echo":
            text = " ".join(argv[1:]).encode() + b"\n"
            await send({"type": "output", "stream": "stdout", "data_b64": base64.b64encode(text).decode()})
        elif argv[0] == "cat":
            await send({"type": "output", "stream": "stdout", "data_b64": body["stdin_b64"]})
        elif argv[0] == "flood":
            for _ in range(int(argv[1])):
                await send({"type": "output", "stream": "stderr", "data_b64": base64.b64encode(b"x" * 1000).decode()})
        elif argv[0] == "broken":
            await send({"type": "error", "error": {"code": "internal", "message": "provider fell over"}})
            return response
        else:
            exit_code = 127
        await send({"type": "result", "exit_code": exit_code, "signal": 0, "wall_s": 0.01, "cpu_s": 0.0,
                    "limits_hit": [], "stdout_bytes": 0, "stderr_bytes": 0})  # fmt: skip
        return response

    async def write(self, request: web.Request) -> web.Response:
        files = self._files(request)
        if files is None:
            return web.json_response({"error": {"message": "no such sandbox"}}, status=404)
        data = await request.read()
        files[request.query["path"]] = data
        return web.json_response({"bytes_written": len(data)})

    async def read(self, request: web.Request) -> web.Response:
        files = self._files(request)
        data = (files or {}).get(request.query["path"])
        if data is None:
            return web.json_response({"error": {"message": "no such file", "field": "path"}}, status=400)
        limited = data[: int(request.query.get("max_bytes", len(data)))]
        return web.Response(body=limited, headers={"X-Miles-File-Size": str(len(data))})

    async def destroy(self, request: web.Request) -> web.Response:
        existed = self.sandboxes.pop(request.match_info["id"], None) is not None
        return web.json_response({"destroyed": existed})


@pytest.fixture
async def provider() -> AsyncIterator[tuple[FakeProvider, str]]:
    fake = FakeProvider()
    runner = web.AppRunner(fake.app())
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    yield fake, f"http://127.0.0.1:{port}"
    await runner.cleanup()


async def _gateway(base_url: str, api_key: str = API_KEY) -> SandboxGateway:
    settings = SandboxSettings(backend="remote", remote={"base_url": base_url, "api_key": api_key}, warm_pool_size=0)
    gateway = SandboxGateway(settings, RemoteBackend(settings), SandboxMetrics(Metrics("sandbox")))
    await gateway.start()
    return gateway


async def _run(gateway: SandboxGateway, sandbox_id: str, **params: Any) -> tuple[bytes, ExecResult]:
    output, result = b"", None
    async for event in gateway.open_exec(sandbox_id, ExecParams(**params)):
        if isinstance(event, ExecResult):
            result = event
        else:
            output += event.data
    assert result is not None
    return output, result


async def test_remote_backend_forwards_every_operation(provider: tuple[FakeProvider, str]) -> None:
    fake, base_url = provider
    gateway = await _gateway(base_url)
    try:
        network = NetworkSpec(NetworkMode.EGRESS_ALLOWLIST, ("10.1.0.0/16:443",))
        created = await gateway.create(CreateParams(job_id="j", limits=Limits(cpu_s=5), network=network))
        assert created.backend == "remote" and not created.sandbox_id.startswith("prov-")  # our own ids
        body = fake.create_bodies[0]
        assert body["template"] == "default" and body["limits"]["cpu_s"] == 5
        assert body["network"] == {"mode": "egress_allowlist", "egress_allowlist": ["10.1.0.0/16:443"]}
        output, result = await _run(gateway, created.sandbox_id, argv=("echo", "hi", "there"), cwd="sub")
        assert output == b"hi there\n" and result.exit_code == 0
        assert fake.exec_bodies[0]["cwd"] == "sub" and fake.exec_bodies[0]["env"]["HOME"] == "/workspace"
        output, _ = await _run(gateway, created.sandbox_id, argv=("cat",), stdin=b"\x00bytes\xff")
        assert output == b"\x00bytes\xff"
        assert await gateway.write_file(created.sandbox_id, "/workspace/a/b", b"data", 0) == 4
        content = await gateway.read_file(created.sandbox_id, "a/b", 2)
        assert (content.data, content.size_bytes, content.truncated) == (b"da", 4, True)
        assert await gateway.destroy(created.sandbox_id)
        assert fake.sandboxes == {}
    finally:
        await gateway.close()


async def test_remote_output_is_capped_on_the_gateway_side(provider: tuple[FakeProvider, str]) -> None:
    _, base_url = provider
    gateway = await _gateway(base_url)
    try:
        sandbox_id = (await gateway.create(CreateParams(limits=Limits(max_output_bytes=2500)))).sandbox_id
        output, _ = await _run(gateway, sandbox_id, argv=("flood", "10"))
        assert len(output) == 2500
    finally:
        await gateway.close()


async def test_remote_failures_surface_as_errors(provider: tuple[FakeProvider, str]) -> None:
    fake, base_url = provider
    gateway = await _gateway(base_url)
    try:
        sandbox_id = (await gateway.create(CreateParams())).sandbox_id
        with pytest.raises(UpstreamError, match="provider fell over"):
            await _run(gateway, sandbox_id, argv=("broken",))
        fake.sandboxes.clear()  # the provider lost it (its own TTL, a crash)
        with pytest.raises(SandboxGoneError):
            await _run(gateway, sandbox_id, argv=("echo",))
        assert await gateway.reap_once() == [sandbox_id]
    finally:
        await gateway.close()


async def test_remote_start_fails_clearly_with_a_wrong_key(provider: tuple[FakeProvider, str]) -> None:
    _, base_url = provider
    with pytest.raises(BackendUnusableError, match="bad key"):
        await _gateway(base_url, api_key="wrong")


async def test_a_miles_gateway_can_be_the_provider(gateway: Gateway) -> None:
    """The HTTP facade is the provider API: a remote-backend gateway fronting a real local-backend one."""
    front = await _gateway(gateway.http_base, api_key="")
    try:
        sandbox_id = (await front.create(CreateParams(job_id="chained"))).sandbox_id
        output, result = await _run(front, sandbox_id, shell="echo from-the-inner-gateway; id -u")
        lines = output.decode().split()
        assert lines[0] == "from-the-inner-gateway" and int(lines[1]) >= 200000 and result.exit_code == 0
        assert await front.write_file(sandbox_id, "f.txt", b"via facade", 0) == 10
        assert (await front.read_file(sandbox_id, "f.txt", 0)).data == b"via facade"
        assert len(gateway.client.list("")) == 1  # the inner gateway holds it
        assert await front.destroy(sandbox_id)
        assert gateway.client.list("") == []
    finally:
        await front.close()
