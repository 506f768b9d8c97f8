"""A small async client of the sandbox gateway's gRPC API: what the `unit_tests` verifier needs.

Create a sandbox, write files, run one shell command collecting its output, destroy it. Failed calls raise
the common error class of their status (`miles.common.grpc_client.error_from_rpc_error`). Every call carries the
job's capability token (`sandbox_token`, minted by the controller), which opens only the job's own sandboxes.
"""

from __future__ import annotations

from dataclasses import dataclass

import grpc

from miles.common.grpc_client import create_channel, error_from_rpc_error
from miles.proto.sandbox.v1 import sandbox_pb2, sandbox_pb2_grpc

_SERVICE = "miles.sandbox.v1.SandboxService"


@dataclass(frozen=True)
class CommandResult:
    exit_code: int
    stdout: str
    stderr: str
    timed_out: bool


def sandbox_metadata(http_url: str, address: str, token: str) -> dict[str, str]:
    """What agents get in `metadata` to reach the gateway: `sandbox_url` (HTTP facade), `sandbox_address`
    (gRPC) and `sandbox_token` (send it as `Authorization: Bearer <token>`), each only when configured."""
    extra = {"sandbox_url": http_url.rstrip("/"), "sandbox_address": address, "sandbox_token": token}
    return {key: value for key, value in extra.items() if value}


class SandboxClient:
    def __init__(self, address: str, *, token: str = "", call_timeout_s: float = 60.0) -> None:
        self._channel = create_channel(address, service_names=[_SERVICE], bearer_token=token)
        self._stub = sandbox_pb2_grpc.SandboxServiceStub(self._channel)  # type: ignore[no-untyped-call]
        self._timeout_s = call_timeout_s

    async def close(self) -> None:
        await self._channel.close()

    async def create(self, job_id: str, *, template: str = "", ttl_s: float = 300.0) -> str:
        request = sandbox_pb2.CreateRequest(job_id=job_id, template=template, ttl_s=ttl_s)
        try:
            response = await self._stub.Create(request, timeout=self._timeout_s)
        except grpc.aio.AioRpcError as exc:
            raise error_from_rpc_error(exc) from exc
        return str(response.sandbox_id)

    async def write_file(self, sandbox_id: str, path: str, data: bytes) -> None:
        request = sandbox_pb2.WriteFileRequest(sandbox_id=sandbox_id, path=path, data=data)
        try:
            await self._stub.WriteFile(request, timeout=self._timeout_s)
        except grpc.aio.AioRpcError as exc:
            raise error_from_rpc_error(exc) from exc

    async def run(self, sandbox_id: str, shell: str, *, timeout_s: float) -> CommandResult:
        request = sandbox_pb2.ExecRequest(sandbox_id=sandbox_id, shell=shell, timeout_s=timeout_s)
        stdout: list[bytes] = []
        stderr: list[bytes] = []
        result: sandbox_pb2.ExecResult | None = None
        try:
            async for event in self._stub.Exec(request, timeout=timeout_s + self._timeout_s):
                if event.HasField("output"):
                    is_stdout = event.output.stream == sandbox_pb2.OUTPUT_STREAM_STDOUT
                    (stdout if is_stdout else stderr).append(event.output.data)
                else:
                    result = event.result
        except grpc.aio.AioRpcError as exc:
            raise error_from_rpc_error(exc) from exc
        if result is None:
            raise RuntimeError("the sandbox gateway ended an exec without a result")
        return CommandResult(
            exit_code=int(result.exit_code),
            stdout=b"".join(stdout).decode(errors="replace"),
            stderr=b"".join(stderr).decode(errors="replace"),
            timed_out=sandbox_pb2.LIMIT_KIND_TIMEOUT in result.limits_hit,
        )

    async def destroy(self, sandbox_id: str) -> None:
        try:
            await self._stub.Destroy(sandbox_pb2.DestroyRequest(sandbox_id=sandbox_id), timeout=self._timeout_s)
        except grpc.aio.AioRpcError as exc:
            raise error_from_rpc_error(exc) from exc
