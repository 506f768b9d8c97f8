"""The remote-provider backend: sandboxes held by an HTTPS service (E2B / Modal / Daytona style).

The provider must speak the sandbox HTTP API — the same one this gateway serves as its HTTP facade
(http_api.py; documented in the README): create, exec (NDJSON stream), files, destroy, list, with
`Authorization: Bearer <api_key>`. So a provider adapter is a thin translation layer at most, and one miles
gateway can also front another (e.g. a cluster gateway behind a regional one).

The gateway keeps its own ids (mapped to the provider's), TTLs and quotas, validates every request before
forwarding it, and caps output on its side too. Network modes are forwarded: the provider must enforce an
egress allowlist or refuse it. What this backend does not protect against is listed in backend.py.
"""

from __future__ import annotations

import base64
import json
import logging
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import Any

import httpx

from miles.common.auth import bearer_headers
from miles.common.errors import MilesError, UpstreamError, error_class_for_http_status
from miles.sandbox.errors import BackendUnusableError, SandboxGoneError, SandboxNotFoundError
from miles.sandbox.models import (
    LIMIT_FIELDS,
    ExecEvent,
    ExecResult,
    ExecSpec,
    FileContent,
    LimitKind,
    OutputChunk,
    SandboxSpec,
)
from miles.sandbox.settings import SandboxSettings

log = logging.getLogger(__name__)


@dataclass
class _RemoteSandbox:
    provider_id: str
    spec: SandboxSpec
    alive: bool = True


def _limits_json(spec: SandboxSpec) -> dict[str, float | int]:
    return {name: getattr(spec.limits, name) for name in LIMIT_FIELDS}


async def _raise_for_status(response: httpx.Response) -> None:
    if response.status_code < 400:
        return
    await response.aread()
    try:
        error: dict[str, Any] = response.json().get("error") or {}
    except ValueError:
        error = {}
    message = str(error.get("message") or response.text[:300] or response.reason_phrase)
    error_class = error_class_for_http_status(response.status_code)
    field = error.get("field")
    raise error_class(f"provider: {message}", field=field if isinstance(field, str) else None)


def _result_from_json(record: dict[str, Any]) -> ExecResult:
    known = {kind.value: kind for kind in LimitKind}
    return ExecResult(
        exit_code=int(record["exit_code"]),
        signal=int(record.get("signal", 0)),
        wall_s=float(record.get("wall_s", 0.0)),
        cpu_s=float(record.get("cpu_s", 0.0)),
        limits_hit=tuple(known[name] for name in record.get("limits_hit", []) if name in known),
        stdout_bytes=int(record.get("stdout_bytes", 0)),
        stderr_bytes=int(record.get("stderr_bytes", 0)),
    )


class RemoteBackend:
    name = "remote"
    supports_egress_allowlist = True

    def __init__(self, settings: SandboxSettings) -> None:
        self.settings = settings
        self.remote = settings.remote
        self._client: httpx.AsyncClient | None = None
        self._sandboxes: dict[str, _RemoteSandbox] = {}

    @property
    def client(self) -> httpx.AsyncClient:
        assert self._client is not None, "start() first"
        return self._client

    async def start(self) -> None:
        self._client = httpx.AsyncClient(
            base_url=self.remote.base_url.rstrip("/"),
            headers=bearer_headers(self.remote.api_key.get_secret_value()),
            timeout=self.remote.request_timeout_s,
            verify=self.remote.verify_tls,
        )
        try:
            await _raise_for_status(await self.client.get("/v1/sandboxes", params={"job_id": "miles-probe"}))
        except (httpx.HTTPError, MilesError) as exc:
            await self._client.aclose()
            raise BackendUnusableError(
                f"the sandbox provider at {self.remote.base_url} is not usable: {exc}", field="remote.base_url"
            ) from None

    async def close(self) -> None:
        for sandbox_id in list(self._sandboxes):
            await self.destroy(sandbox_id)
        if self._client is not None:
            await self._client.aclose()

    def _live(self, sandbox_id: str) -> _RemoteSandbox:
        sandbox = self._sandboxes.get(sandbox_id)
        if sandbox is None:
            raise SandboxNotFoundError(f"no sandbox {sandbox_id!r}", field="sandbox_id")
        if not sandbox.alive:
            raise SandboxGoneError(f"the provider no longer has sandbox {sandbox_id!r}", field="sandbox_id")
        return sandbox

    async def _checked(self, sandbox: _RemoteSandbox, response: httpx.Response) -> None:
        if response.status_code == 404:
            sandbox.alive = False
            raise SandboxGoneError("the provider no longer has this sandbox", field="sandbox_id")
        await _raise_for_status(response)

    async def create(self, sandbox_id: str, spec: SandboxSpec) -> None:
        body = {
            "template": spec.template_name,
            "limits": _limits_json(spec),
            "network": {"mode": spec.network.mode.value, "egress_allowlist": list(spec.network.egress_allowlist)},
        }
        try:
            response = await self.client.post("/v1/sandboxes", json=body)
            await _raise_for_status(response)
            provider_id = str(response.json()["sandbox_id"])
        except (httpx.HTTPError, KeyError, ValueError) as exc:
            raise UpstreamError(f"the provider did not create a sandbox: {exc}") from None
        self._sandboxes[sandbox_id] = _RemoteSandbox(provider_id, spec)

    async def adopt(self, sandbox_id: str, spec: SandboxSpec) -> bool:
        sandbox = self._sandboxes.get(sandbox_id)
        # The provider fixed the limits at creation: only an identical spec fits.
        return sandbox is not None and sandbox.alive and spec == sandbox.spec

    def is_alive(self, sandbox_id: str) -> bool:
        sandbox = self._sandboxes.get(sandbox_id)
        return sandbox is not None and sandbox.alive

    async def exec(self, sandbox_id: str, spec: ExecSpec) -> AsyncGenerator[ExecEvent, None]:
        sandbox = self._live(sandbox_id)
        workdir = sandbox.spec.workdir.rstrip("/")
        body = {
            "argv": list(spec.argv),
            "stdin_b64": base64.b64encode(spec.stdin).decode(),
            "timeout_s": spec.timeout_s,
            "cwd": spec.cwd.removeprefix(workdir).lstrip("/"),
            "env": dict(spec.env),
            "stream": True,
        }
        timeout = httpx.Timeout(self.remote.request_timeout_s, read=spec.timeout_s + self.remote.request_timeout_s)
        delivered = {"stdout": 0, "stderr": 0}
        url = f"/v1/sandboxes/{sandbox.provider_id}/exec"
        async with self.client.stream("POST", url, json=body, timeout=timeout) as response:
            await self._checked(sandbox, response)
            async for line in response.aiter_lines():
                if not line.strip():
                    continue
                record = json.loads(line)
                if record.get("type") == "output" and record.get("stream") in delivered:
                    stream_name = record["stream"]
                    data = base64.b64decode(record["data_b64"])
                    room = spec.limits.max_output_bytes - delivered[stream_name]
                    data = data[: max(room, 0)]
                    if data:
                        delivered[stream_name] += len(data)
                        yield OutputChunk(stream_name, data)
                elif record.get("type") == "result":
                    yield _result_from_json(record)
                    return
                elif record.get("type") == "error":
                    error = record.get("error") or {}
                    raise UpstreamError(f"provider: {error.get('message', error)}")
        raise UpstreamError("the provider's exec stream ended without a result")

    async def write_file(self, sandbox_id: str, parts: tuple[str, ...], data: bytes, mode: int) -> int:
        sandbox = self._live(sandbox_id)
        response = await self.client.put(
            f"/v1/sandboxes/{sandbox.provider_id}/files",
            params={"path": "/".join(parts), "mode": f"{mode:o}"},
            content=data,
        )
        await self._checked(sandbox, response)
        return int(response.json()["bytes_written"])

    async def read_file(self, sandbox_id: str, parts: tuple[str, ...], max_bytes: int) -> FileContent:
        sandbox = self._live(sandbox_id)
        response = await self.client.get(
            f"/v1/sandboxes/{sandbox.provider_id}/files", params={"path": "/".join(parts), "max_bytes": max_bytes}
        )
        await self._checked(sandbox, response)
        data = response.content[:max_bytes]
        size_bytes = int(response.headers.get("X-Miles-File-Size", len(data)))
        return FileContent(data=data, size_bytes=size_bytes, truncated=len(data) < size_bytes)

    async def destroy(self, sandbox_id: str) -> None:
        sandbox = self._sandboxes.pop(sandbox_id, None)
        if sandbox is None:
            return
        try:
            response = await self.client.delete(f"/v1/sandboxes/{sandbox.provider_id}")
            if response.status_code != 404:
                await _raise_for_status(response)
        except (httpx.HTTPError, MilesError) as exc:
            # The provider's own TTL ends it eventually; the gateway has forgotten it either way.
            log.warning("the provider did not destroy a sandbox", extra={"sandbox_id": sandbox_id, "error": str(exc)})
