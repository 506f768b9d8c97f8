"""HTTP facade: the gRPC API's operations as JSON over HTTP, for agents that prefer plain HTTP.

Routes (under /v1/sandboxes; errors are {"error": {"code", "message", "field"?}} with the common status
mapping — unknown sandbox 404, invalid input 400 naming the field, oversized body 413, quota 429):

  POST   /v1/sandboxes                     create    body CreateBody -> 201 CreateReply
  GET    /v1/sandboxes?job_id=             list      -> {"sandboxes": [SandboxInfoBody]}
  POST   /v1/sandboxes/{id}/exec           exec      body ExecBody -> application/x-ndjson stream of
                                                     {"type": "output", "stream", "data_b64"} lines and one
                                                     {"type": "result", ...ExecResultBody} line (or, mid-stream,
                                                     {"type": "error", "error": {...}}); with "stream": false
                                                     one JSON ExecCollected
  PUT    /v1/sandboxes/{id}/files?path=&mode=   write  raw body (mode: octal text, default 644)
  GET    /v1/sandboxes/{id}/files?path=&max_bytes=  read -> raw bytes, X-Miles-File-Size, X-Miles-Truncated
  DELETE /v1/sandboxes/{id}                destroy   -> {"destroyed": bool} (idempotent)

Every route needs `Authorization: Bearer <token>` unless the gateway runs open (access.py): 401 without a token,
403 for a token that is not accepted, 404 (destroy: `destroyed: false`) for another job's sandbox. /healthz,
/readyz and /metrics (the common app's) stay open.

This is also the API the remote backend speaks to a provider (see remote_backend.py). What each route answers
(statuses, media types, headers) and the bounds of its input are in the OpenAPI document (openapi_docs.py).

Bounds are checked once for both transports by validation.py (400 naming the field); the body models only state
them in the schema (`json_schema_extra`), so that HTTP and gRPC refuse the same input the same way.
"""

from __future__ import annotations

import base64
import binascii
import json
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Body, Header, Query, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from miles.common.auth import AUTH_RESPONSES
from miles.common.errors import MilesError
from miles.sandbox.access import SandboxAccess
from miles.sandbox.core import SandboxGateway
from miles.sandbox.errors import FileTooLargeError, InvalidSandboxRequestError
from miles.sandbox.models import (
    LIMIT_FIELDS,
    CreateParams,
    ExecEvent,
    ExecParams,
    ExecResult,
    Limits,
    NetworkMode,
    NetworkSpec,
    OutputChunk,
    SandboxInfo,
)
from miles.sandbox.openapi_docs import (
    CREATE_EXAMPLES,
    CREATE_RESPONSES,
    EXEC_EXAMPLES,
    EXEC_RESPONSES,
    FILE_PATH_EXAMPLES,
    INVALID,
    NDJSON,
    READ_RESPONSES,
    WRITE_BODY,
    WRITE_RESPONSES,
)
from miles.sandbox.validation import MAX_JOB_ID_CHARS, MAX_PATH_CHARS

Authorization = Annotated[
    str | None,
    Header(description="`Bearer <token>`: the gateway's operator token, or the job's capability (sandbox_token)"),
]
BASE64_PATTERN = r"^(?:[A-Za-z0-9+/]{4})*(?:[A-Za-z0-9+/]{2}==|[A-Za-z0-9+/]{3}=)?$"
"""What `base64.b64decode(validate=True)` accepts."""
NON_NEGATIVE: dict[str, Any] = {"minimum": 0}
"""Stated in the schema, checked by validation.py (0 = the template's or the gateway's default)."""


FilePath = Annotated[
    str,
    Query(
        description="A file in the work dir (relative, or absolute under it)",
        openapi_examples=FILE_PATH_EXAMPLES,
        json_schema_extra={"minLength": 1, "maxLength": MAX_PATH_CHARS, "pattern": "^[^\\x00]+$"},
    ),
]
FileMode = Annotated[
    str,
    Query(description="Octal permission bits, e.g. 644 (empty: 644)", json_schema_extra={"pattern": "^[0-7]{0,3}$"}),
]
MaxBytes = Annotated[int, Query(description="Most bytes to return (0: max_read_bytes)", json_schema_extra=NON_NEGATIVE)]


class Destroyed(BaseModel):
    destroyed: bool = Field(description="False for an id that is not live (or is another job's sandbox)")


class LimitsBody(BaseModel):
    """Same fields and units as the proto's Limits; 0 = template default."""

    model_config = ConfigDict(extra="forbid")

    cpu_s: float = Field(default=0.0, json_schema_extra=NON_NEGATIVE)
    memory_bytes: int = Field(default=0, json_schema_extra=NON_NEGATIVE)
    max_processes: int = Field(default=0, json_schema_extra=NON_NEGATIVE)
    max_open_files: int = Field(default=0, json_schema_extra=NON_NEGATIVE)
    max_file_bytes: int = Field(default=0, json_schema_extra=NON_NEGATIVE)
    max_output_bytes: int = Field(default=0, json_schema_extra=NON_NEGATIVE)

    def to_limits(self) -> Limits:
        return Limits(**self.model_dump())

    @classmethod
    def of(cls, limits: Limits) -> LimitsBody:
        return cls(**{name: getattr(limits, name) for name in LIMIT_FIELDS})


class NetworkBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    mode: Literal["none", "egress_allowlist"] = "none"
    egress_allowlist: list[str] = Field(default_factory=list)


class CreateBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    job_id: str = Field(default="", json_schema_extra={"maxLength": MAX_JOB_ID_CHARS})
    template: str = Field(default="", description="A template of the gateway's; empty: its default template")
    env: dict[str, str] = Field(default_factory=dict)
    limits: LimitsBody = LimitsBody()
    ttl_s: float = Field(
        default=0.0,
        description="Idle seconds before the reaper destroys the sandbox; 0: the gateway's default_ttl_s",
        json_schema_extra=NON_NEGATIVE,
    )
    network: NetworkBody = NetworkBody()


class CreateReply(BaseModel):
    sandbox_id: str
    backend: str
    startup_s: float
    limits: LimitsBody
    warm: bool


EXEC_BODY_RULES: dict[str, Any] = {
    "allOf": [
        {
            "oneOf": [
                {"required": ["argv"], "properties": {"argv": {"type": "array"}}},
                {"required": ["shell"], "properties": {"shell": {"type": "string"}}},
            ]
        },
        {
            "not": {
                "required": ["stdin", "stdin_b64"],
                "properties": {"stdin": {"minLength": 1}, "stdin_b64": {"minLength": 1}},
            }
        },
    ]
}
"""ExecBody's rules across fields, stated in the schema (validation.py checks them, naming the field)."""


class ExecBody(BaseModel):
    """Exactly one of argv / shell. stdin as text (UTF-8) or stdin_b64 (bytes), not both."""

    model_config = ConfigDict(extra="forbid", json_schema_extra=EXEC_BODY_RULES)

    argv: list[str] | None = Field(default=None, json_schema_extra={"minItems": 1})
    shell: str | None = None
    stdin: str = ""
    stdin_b64: str = Field(default="", json_schema_extra={"contentEncoding": "base64", "pattern": BASE64_PATTERN})
    timeout_s: float = Field(
        default=0.0, description="Wall-clock limit, seconds; 0: the gateway's default", json_schema_extra=NON_NEGATIVE
    )
    cwd: str = ""
    env: dict[str, str] = Field(default_factory=dict)
    stream: bool = True


class ExecResultBody(BaseModel):
    exit_code: int
    signal: int
    wall_s: float
    cpu_s: float
    limits_hit: list[str]
    stdout_bytes: int
    stderr_bytes: int

    @classmethod
    def of(cls, result: ExecResult) -> ExecResultBody:
        return cls(
            exit_code=result.exit_code,
            signal=result.signal,
            wall_s=result.wall_s,
            cpu_s=result.cpu_s,
            limits_hit=[kind.value for kind in result.limits_hit],
            stdout_bytes=result.stdout_bytes,
            stderr_bytes=result.stderr_bytes,
        )


class ExecCollected(BaseModel):
    """A whole exec at once; stdout/stderr as text (invalid UTF-8 replaced) and as base64 bytes."""

    stdout: str
    stderr: str
    stdout_b64: str
    stderr_b64: str
    result: ExecResultBody


class SandboxInfoBody(BaseModel):
    sandbox_id: str
    job_id: str
    backend: str
    template: str
    created_at_unix_ms: int
    last_used_unix_ms: int
    ttl_s: float
    limits: LimitsBody
    network_mode: str
    active_execs: int

    @classmethod
    def of(cls, info: SandboxInfo) -> SandboxInfoBody:
        return cls(**{**info.__dict__, "limits": LimitsBody.of(info.limits), "network_mode": info.network_mode.value})


def _stdin_bytes(body: ExecBody) -> bytes:
    if body.stdin and body.stdin_b64:
        raise InvalidSandboxRequestError("give stdin or stdin_b64, not both", field="stdin")
    if body.stdin_b64:
        try:
            return base64.b64decode(body.stdin_b64, validate=True)
        except (binascii.Error, ValueError):
            raise InvalidSandboxRequestError("stdin_b64 is not valid base64", field="stdin_b64") from None
    return body.stdin.encode()


def _event_line(event: ExecEvent) -> bytes:
    if isinstance(event, OutputChunk):
        record: dict[str, object] = {
            "type": "output",
            "stream": event.stream,
            "data_b64": base64.b64encode(event.data).decode(),
        }
    else:
        record = {"type": "result", **ExecResultBody.of(event).model_dump()}
    return json.dumps(record).encode() + b"\n"


async def _ndjson(events: AsyncGenerator[ExecEvent, None]) -> AsyncIterator[bytes]:
    try:
        async for event in events:
            yield _event_line(event)
    except MilesError as error:
        yield json.dumps({"type": "error", "error": error.to_dict()}).encode() + b"\n"
    finally:
        await events.aclose()


async def _collect(events: AsyncIterator[ExecEvent]) -> ExecCollected:
    output: dict[str, list[bytes]] = {"stdout": [], "stderr": []}
    result: ExecResult | None = None
    async for event in events:
        if isinstance(event, OutputChunk):
            output[event.stream].append(event.data)
        else:
            result = event
    assert result is not None, "an exec always ends with a result"
    stdout, stderr = b"".join(output["stdout"]), b"".join(output["stderr"])
    return ExecCollected(
        stdout=stdout.decode(errors="replace"),
        stderr=stderr.decode(errors="replace"),
        stdout_b64=base64.b64encode(stdout).decode(),
        stderr_b64=base64.b64encode(stderr).decode(),
        result=ExecResultBody.of(result),
    )


async def _read_body_capped(request: Request, max_bytes: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise FileTooLargeError(f"body is {declared} bytes, above max_write_bytes={max_bytes}", field="data")
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise FileTooLargeError(f"body is larger than max_write_bytes={max_bytes}", field="data")
        chunks.append(chunk)
    return b"".join(chunks)


def _parse_mode(mode: str) -> int:
    if not mode:
        return 0
    try:
        return int(mode, 8)
    except ValueError:
        raise InvalidSandboxRequestError(f"mode must be octal text such as 644, got {mode!r}", field="mode") from None


def build_router(gateway: SandboxGateway, access: SandboxAccess) -> APIRouter:
    router = APIRouter(prefix="/v1/sandboxes", tags=["sandboxes"], responses=AUTH_RESPONSES)

    @router.post("", status_code=201, responses=CREATE_RESPONSES)
    async def create_sandbox(
        body: Annotated[CreateBody, Body(openapi_examples=CREATE_EXAMPLES)], authorization: Authorization = None
    ) -> CreateReply:
        access.check_create(authorization, body.job_id)
        created = await gateway.create(
            CreateParams(
                job_id=body.job_id,
                template=body.template,
                env=body.env,
                limits=body.limits.to_limits(),
                ttl_s=body.ttl_s,
                network=NetworkSpec(NetworkMode(body.network.mode), tuple(body.network.egress_allowlist)),
            )
        )
        return CreateReply(
            sandbox_id=created.sandbox_id,
            backend=created.backend,
            startup_s=created.startup_s,
            limits=LimitsBody.of(created.limits),
            warm=created.warm,
        )

    @router.get("", responses=INVALID)
    async def list_sandboxes(job_id: str = "", authorization: Authorization = None) -> dict[str, list[SandboxInfoBody]]:
        access.check_list(authorization, job_id)
        return {"sandboxes": [SandboxInfoBody.of(info) for info in gateway.list_sandboxes(job_id)]}

    @router.post(
        "/{sandbox_id}/exec",
        response_model=None,
        responses={**EXEC_RESPONSES, 200: {**EXEC_RESPONSES[200], "model": ExecCollected}},
    )
    async def exec_in_sandbox(
        sandbox_id: str,
        body: Annotated[ExecBody, Body(openapi_examples=EXEC_EXAMPLES)],
        authorization: Authorization = None,
    ) -> Response | ExecCollected:
        access.check_sandbox(authorization, sandbox_id)
        params = ExecParams(
            argv=tuple(body.argv) if body.argv is not None else None,
            shell=body.shell,
            stdin=_stdin_bytes(body),
            timeout_s=body.timeout_s,
            cwd=body.cwd,
            env=body.env,
        )
        events = gateway.open_exec(sandbox_id, params)  # NOT_FOUND / invalid input raise here, before the 200
        if not body.stream:
            return await _collect(events)
        return StreamingResponse(_ndjson(events), media_type=NDJSON)

    @router.put("/{sandbox_id}/files", responses=WRITE_RESPONSES, openapi_extra=WRITE_BODY)
    async def write_file(
        sandbox_id: str, request: Request, path: FilePath, mode: FileMode = "", authorization: Authorization = None
    ) -> dict[str, int]:
        access.check_sandbox(authorization, sandbox_id)
        gateway.ensure_exists(sandbox_id)  # 404 before reading a body for nothing
        data = await _read_body_capped(request, gateway.settings.max_write_bytes)
        written = await gateway.write_file(sandbox_id, path, data, _parse_mode(mode))
        return {"bytes_written": written}

    @router.get("/{sandbox_id}/files", response_class=Response, responses=READ_RESPONSES)
    async def read_file(
        sandbox_id: str, path: FilePath, max_bytes: MaxBytes = 0, authorization: Authorization = None
    ) -> Response:
        access.check_sandbox(authorization, sandbox_id)
        content = await gateway.read_file(sandbox_id, path, max_bytes)
        headers = {"X-Miles-File-Size": str(content.size_bytes), "X-Miles-Truncated": str(content.truncated).lower()}
        return Response(content.data, media_type="application/octet-stream", headers=headers)

    @router.delete("/{sandbox_id}", response_model=Destroyed)
    async def destroy_sandbox(sandbox_id: str, authorization: Authorization = None) -> JSONResponse:
        # Another job's sandbox is left alone and answered like an unknown id: idempotent, and nothing revealed.
        destroyed = access.sees_sandbox(authorization, sandbox_id) and await gateway.destroy(sandbox_id)
        return JSONResponse({"destroyed": destroyed})

    return router
