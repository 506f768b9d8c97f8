"""gRPC transport (miles.sandbox.v1.SandboxService): parse the proto, call the core, build the response.

Errors are raised as MilesError subclasses and mapped to status codes by miles.common's interceptor. Every RPC
first checks the caller's `authorization: Bearer <token>` metadata against the ids it names (access.py):
UNAUTHENTICATED without a token, PERMISSION_DENIED for one not accepted, NOT_FOUND (Destroy: destroyed=false) for
another job's sandbox. Health and reflection stay open.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import grpc

from miles.proto.sandbox.v1 import sandbox_pb2, sandbox_pb2_grpc
from miles.sandbox.access import SandboxAccess
from miles.sandbox.core import SandboxGateway
from miles.sandbox.errors import InvalidSandboxRequestError
from miles.sandbox.models import (
    CreateParams,
    ExecEvent,
    ExecParams,
    LimitKind,
    Limits,
    NetworkMode,
    NetworkSpec,
    OutputChunk,
    SandboxInfo,
)

SERVICE_NAME = "miles.sandbox.v1.SandboxService"

_NETWORK_FROM_PROTO = {
    sandbox_pb2.NETWORK_MODE_UNSPECIFIED: NetworkMode.NONE,
    sandbox_pb2.NETWORK_MODE_NONE: NetworkMode.NONE,
    sandbox_pb2.NETWORK_MODE_EGRESS_ALLOWLIST: NetworkMode.EGRESS_ALLOWLIST,
}
_NETWORK_TO_PROTO = {
    NetworkMode.NONE: sandbox_pb2.NETWORK_MODE_NONE,
    NetworkMode.EGRESS_ALLOWLIST: sandbox_pb2.NETWORK_MODE_EGRESS_ALLOWLIST,
}
_LIMIT_KIND_TO_PROTO = {
    LimitKind.TIMEOUT: sandbox_pb2.LIMIT_KIND_TIMEOUT,
    LimitKind.CPU: sandbox_pb2.LIMIT_KIND_CPU,
    LimitKind.MEMORY: sandbox_pb2.LIMIT_KIND_MEMORY,
    LimitKind.PROCESSES: sandbox_pb2.LIMIT_KIND_PROCESSES,
    LimitKind.FILE_SIZE: sandbox_pb2.LIMIT_KIND_FILE_SIZE,
    LimitKind.OUTPUT: sandbox_pb2.LIMIT_KIND_OUTPUT,
}
_STREAM_TO_PROTO = {"stdout": sandbox_pb2.OUTPUT_STREAM_STDOUT, "stderr": sandbox_pb2.OUTPUT_STREAM_STDERR}


def limits_from_proto(limits: sandbox_pb2.Limits) -> Limits:
    return Limits(
        cpu_s=limits.cpu_s,
        memory_bytes=limits.memory_bytes,
        max_processes=limits.max_processes,
        max_open_files=limits.max_open_files,
        max_file_bytes=limits.max_file_bytes,
        max_output_bytes=limits.max_output_bytes,
    )


def limits_to_proto(limits: Limits) -> sandbox_pb2.Limits:
    return sandbox_pb2.Limits(
        cpu_s=limits.cpu_s,
        memory_bytes=limits.memory_bytes,
        max_processes=limits.max_processes,
        max_open_files=limits.max_open_files,
        max_file_bytes=limits.max_file_bytes,
        max_output_bytes=limits.max_output_bytes,
    )


def create_params_from_proto(request: sandbox_pb2.CreateRequest) -> CreateParams:
    if request.network.mode not in _NETWORK_FROM_PROTO:
        raise InvalidSandboxRequestError("network.mode is not a known NetworkMode", field="network.mode")
    return CreateParams(
        job_id=request.job_id,
        template=request.template,
        env=dict(request.env),
        limits=limits_from_proto(request.limits),
        ttl_s=request.ttl_s,
        network=NetworkSpec(_NETWORK_FROM_PROTO[request.network.mode], tuple(request.network.egress_allowlist)),
    )


def exec_params_from_proto(request: sandbox_pb2.ExecRequest) -> ExecParams:
    command = request.WhichOneof("command")
    return ExecParams(
        argv=tuple(request.argv.args) if command == "argv" else None,
        shell=request.shell if command == "shell" else None,
        stdin=request.stdin,
        timeout_s=request.timeout_s,
        cwd=request.cwd,
        env=dict(request.env),
    )


def event_to_proto(event: ExecEvent) -> sandbox_pb2.ExecEvent:
    if isinstance(event, OutputChunk):
        return sandbox_pb2.ExecEvent(
            output=sandbox_pb2.OutputChunk(stream=_STREAM_TO_PROTO[event.stream], data=event.data)
        )
    return sandbox_pb2.ExecEvent(
        result=sandbox_pb2.ExecResult(
            exit_code=event.exit_code,
            signal=event.signal,
            wall_s=event.wall_s,
            cpu_s=event.cpu_s,
            limits_hit=[_LIMIT_KIND_TO_PROTO[kind] for kind in event.limits_hit],
            stdout_bytes=event.stdout_bytes,
            stderr_bytes=event.stderr_bytes,
        )
    )


def info_to_proto(info: SandboxInfo) -> sandbox_pb2.SandboxInfo:
    return sandbox_pb2.SandboxInfo(
        sandbox_id=info.sandbox_id,
        job_id=info.job_id,
        backend=info.backend,
        template=info.template,
        created_at_unix_ms=info.created_at_unix_ms,
        last_used_unix_ms=info.last_used_unix_ms,
        ttl_s=info.ttl_s,
        limits=limits_to_proto(info.limits),
        network_mode=_NETWORK_TO_PROTO[info.network_mode],
        active_execs=info.active_execs,
    )


def authorization_of(context: grpc.aio.ServicerContext) -> str | None:
    """The call's `authorization` metadata value (None when absent)."""
    for key, value in context.invocation_metadata() or ():
        if key == "authorization" and isinstance(value, str):
            return value
    return None


class SandboxServicer(sandbox_pb2_grpc.SandboxServiceServicer):
    def __init__(self, gateway: SandboxGateway, access: SandboxAccess) -> None:
        self.gateway = gateway
        self.access = access

    async def Create(
        self, request: sandbox_pb2.CreateRequest, context: grpc.aio.ServicerContext
    ) -> sandbox_pb2.CreateResponse:
        self.access.check_create(authorization_of(context), request.job_id)
        created = await self.gateway.create(create_params_from_proto(request))
        return sandbox_pb2.CreateResponse(
            sandbox_id=created.sandbox_id,
            backend=created.backend,
            startup_s=created.startup_s,
            limits=limits_to_proto(created.limits),
            warm=created.warm,
        )

    async def Exec(
        self, request: sandbox_pb2.ExecRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[sandbox_pb2.ExecEvent]:
        self.access.check_sandbox(authorization_of(context), request.sandbox_id)
        events = self.gateway.open_exec(request.sandbox_id, exec_params_from_proto(request))
        async with contextlib.aclosing(events):
            async for event in events:
                yield event_to_proto(event)

    async def WriteFile(
        self, request: sandbox_pb2.WriteFileRequest, context: grpc.aio.ServicerContext
    ) -> sandbox_pb2.WriteFileResponse:
        self.access.check_sandbox(authorization_of(context), request.sandbox_id)
        written = await self.gateway.write_file(request.sandbox_id, request.path, request.data, request.mode)
        return sandbox_pb2.WriteFileResponse(bytes_written=written)

    async def ReadFile(
        self, request: sandbox_pb2.ReadFileRequest, context: grpc.aio.ServicerContext
    ) -> sandbox_pb2.ReadFileResponse:
        self.access.check_sandbox(authorization_of(context), request.sandbox_id)
        content = await self.gateway.read_file(request.sandbox_id, request.path, request.max_bytes)
        return sandbox_pb2.ReadFileResponse(
            data=content.data, size_bytes=content.size_bytes, truncated=content.truncated
        )

    async def Destroy(
        self, request: sandbox_pb2.DestroyRequest, context: grpc.aio.ServicerContext
    ) -> sandbox_pb2.DestroyResponse:
        # Another job's sandbox is left alone and answered like an unknown id: idempotent, and nothing revealed.
        seen = self.access.sees_sandbox(authorization_of(context), request.sandbox_id)
        return sandbox_pb2.DestroyResponse(destroyed=seen and await self.gateway.destroy(request.sandbox_id))

    async def List(
        self, request: sandbox_pb2.ListRequest, context: grpc.aio.ServicerContext
    ) -> sandbox_pb2.ListResponse:
        self.access.check_list(authorization_of(context), request.job_id)
        infos = self.gateway.list_sandboxes(request.job_id)
        return sandbox_pb2.ListResponse(sandboxes=[info_to_proto(info) for info in infos])
